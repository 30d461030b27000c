"""The schema check's machinery, run here against the CPU simulation (CI runs it against the real
torch_npu in its own venv: .ci/ascend_schema_check.sh)."""
import os
import subprocess

import torch
from helpers import ROOT

from hal.ascend import ops, schema_check, schemas
from hal.ascend.sim.npu import GRAPH_UPDATABLE, SimNpu


def test_every_call_site_has_a_recorded_schema_and_a_simulation():
    for site in ops.CALL_SITES.values():
        assert site.op in schemas.SCHEMAS, site
        assert callable(getattr(SimNpu, site.op)), site
        # the ops a graph update reaches are exactly those torch_npu's graph handlers record; a site
        # updates the keys it passes (the int8 decode call passes no cumulative query lengths)
        assert bool(site.update_keys) == (site.op in GRAPH_UPDATABLE), site
        assert set(site.update_keys) <= set(GRAPH_UPDATABLE.get(site.op, ())), site
    for op in schemas.SCHEMAS:
        assert schemas.parsed(op).name.endswith(op)


def test_exercise_covers_every_call_site():
    coverage = schema_check.site_coverage(SimNpu(), "cpu")
    assert coverage.keys() == ops.CALL_SITES.keys()
    assert all(n > 0 for n in coverage.values()), coverage


def test_exercise_runs_on_meta_tensors_through_the_hal():
    """On meta tensors only shapes flow: what the CI check feeds torch_npu's meta kernels."""
    recorder = schema_check.RecordingLib(_MetaShapes())
    schema_check.exercise(schema_check.CheckHal(recorder, "meta"))
    assert {op for op, _ in recorder.calls} == {s.op for s in ops.CALL_SITES.values()}


class _MetaShapes:
    """Binds every call to its recorded schema and returns meta outputs of the documented shapes."""

    def __getattr__(self, op):
        def call(*args, **kwargs):
            a = schemas.bind(op, args, kwargs)
            first = next(v for v in a.values() if isinstance(v, torch.Tensor))
            if op == "npu_fused_infer_attention_score":
                return torch.empty_like(first), torch.empty(0, device="meta")
            if op in ("npu_rms_norm", "npu_add_rms_norm"):
                rstd = torch.empty(*first.shape[:-1], 1, device="meta")
                return (torch.empty_like(first), rstd) + ((torch.empty_like(first),) if "x2" in a else ())
            if op == "npu_apply_rotary_pos_emb":
                return a["query"], a["key"]
            if op == "npu_swiglu":
                return torch.empty(*first.shape[:-1], first.shape[-1] // 2, device="meta", dtype=first.dtype)
            return torch.empty_like(first) if op == "npu_rotary_mul" else None
        return call


def test_wrong_calls_are_caught():
    caught = schema_check.caught_mutations(SimNpu(), "cpu")
    assert caught.keys() == schema_check.MUTATIONS.keys()
    missed = [label for label, error in caught.items() if not error]
    assert not missed, missed


def test_ci_script_is_wired_and_skips_without_a_compiler(tmp_path):
    script = ROOT / ".ci" / "ascend_schema_check.sh"
    assert os.access(script, os.X_OK) and "ascend_schema_check.sh" in (ROOT / ".ci" / "run").read_text()
    proc = subprocess.run(["/bin/bash", str(script)], env={"PATH": str(tmp_path)}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "SKIPPED: 'gcc' not found" in proc.stdout, proc.stdout + proc.stderr
