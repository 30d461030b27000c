"""bench_kernels() at toy shapes in the Triton interpreter: the benchmark the lead runs on the H200
must not fail on a typo (timings here are meaningless; `_time_us` just runs the function once)."""
from __future__ import annotations

import pytest
import torch

import kernel_bench as bench
from hal.kernels.configs import KernelConfig

pytestmark = pytest.mark.usefixtures("interpreted")


def test_bench_runs_every_cell_at_toy_shapes(monkeypatch):
    monkeypatch.setattr(bench, "SHAPE", dict(num_heads=4, num_kv_heads=2, head_dim=32, hidden=64,
                                             intermediate=48, page=16))
    monkeypatch.setattr(bench, "DECODE_CELLS", [(2, 40)])
    monkeypatch.setattr(bench, "PREFILL_CELLS", [(20, 9)])
    monkeypatch.setattr(bench, "SMALL_OP_TOKENS", (3,))
    monkeypatch.setattr(bench, "SWEEP_CELLS", [(2, 20, 1), (1, 0, 24)])
    monkeypatch.setattr(bench, "DECODE_SWEEP", [KernelConfig(16, 32, 4, 2)])
    monkeypatch.setattr(bench, "PREFILL_SWEEP", [KernelConfig(32, 16, 4, 2)])
    monkeypatch.setattr(bench, "L2_BYTES", 1)
    monkeypatch.setattr(bench, "measure_ceilings", lambda device: (4.27e12, 790e12))
    monkeypatch.setattr(bench, "_time_us", lambda fn, graph: (fn(), 10.0)[1])
    lines: list[str] = []
    rows = bench.bench_kernels("cpu", torch.bfloat16, sweep=True, print_fn=lines.append)
    kernels = {r["kernel"] for r in rows}
    assert {"attention_decode", "attention_prefill", "torch sdpa (dense)", "rms_norm+residual",
            "norm_add_norm", "norm_add_norm (sum_first)", "norm_add_norm (pre-norm)", "rotary (neox)",
            "silu_and_mul", "kv_write"} <= kernels
    errors = [float(r["note"].split("max err ")[1].split()[0]) for r in rows if "max err" in r["note"]]
    assert errors and max(errors) < 3e-2, rows          # the bench checks attention against the reference
    assert any(line.startswith("# best for") for line in lines)


def test_decode_kernels_bench_runs_every_group_at_toy_shapes(monkeypatch):
    """tools/decode_kernels_bench.py (the lead's H200 call) at toy shapes: every group runs, checks
    its cells, prints the summary; a failing cell is a row, not a crash."""
    import decode_kernels_bench as dkb
    from hal.kernels import fresh

    monkeypatch.setattr(dkb, "SHAPES", {"qkv": (96, 64), "o": (64, 64), "gate_up": (80, 64), "down": (64, 48),
                                        "lm_head": (128, 64)})
    monkeypatch.setattr(dkb, "ROWS", (1, 3))
    monkeypatch.setattr(dkb, "HEADS", 4)
    monkeypatch.setattr(dkb, "KV_HEADS", 2)
    monkeypatch.setattr(dkb, "HEAD_DIM", 32)
    monkeypatch.setattr(dkb, "PREFILL_CASES", ("48", "2x24"))
    monkeypatch.setattr(dkb, "SWEEP_SHAPES", ("o",))
    monkeypatch.setattr(dkb, "M1_SWEEP", [dkb.M1_SWEEP[0], KernelConfig(1, 16, 4, 2)])  # block_k 0: fails
    monkeypatch.setattr(dkb, "ROWS_SWEEP", dkb.ROWS_SWEEP[:1])
    monkeypatch.setattr(dkb, "L2_BYTES", 1)
    monkeypatch.setattr(dkb, "time_calls", lambda calls: ([c() for c in calls], (10.0, "graph"))[1])
    monkeypatch.setattr(fresh, "_flash_varlen", lambda q, k, v, cu, *a, scale: (
        fresh.attention("sdpa", q, k, v, cu, (cu[1:] - cu[:-1]).tolist(), scale),))
    lines: list[str] = []
    bench = dkb.run("cpu", budget_s=600, print_fn=lines.append)
    groups = {r.group for r in bench.rows if r.us}
    assert groups == {"proj", "fused", "rope+kv", "prefill", "sweep"}, lines
    checked = [r.err for r in bench.rows if r.err is not None]
    assert checked and max(checked) < 1e-2, lines
    failed = [r for r in bench.rows if r.note.startswith("ERROR")]
    assert [(r.shape, " k0 " in r.variant) for r in failed] == [("o", True), ("gate_up+nrl", True)]   # block_k=0
    assert any(line.startswith("# batch-1 step") for line in lines)
    assert sum("vs own K/V paged, output rel err" in line for line in lines) == 2, lines
    monkeypatch.setattr(dkb, "WIDE_ROWS", (20,))
    monkeypatch.setattr(dkb, "WIDE_SWEEP", dkb.WIDE_SWEEP[:1])
    wide = dkb.run("cpu", budget_s=600, print_fn=lines.append, groups=("wide",))
    assert {r.group for r in wide.rows} == {"wide"} and len(wide.rows) == 2 * 5, lines
    assert all(r.us for r in wide.rows) and max(r.err for r in wide.rows if r.err is not None) < 1e-2, lines
