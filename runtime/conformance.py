"""The conformance suite's numerics check (level R3): the golden cases through the runtime on a
Hal's device, and `python -m runtime.conformance hal=<name>`, the whole suite with it.

The Hal-level checks live in `hal.conformance`, which imports neither runtime nor zoo; this check
reaches it as an argument (`main(..., extra=...)`) or through the entry-point group
`loopstack.conformance` (an installed loopstack registers it, so `python -m hal.conformance` runs
it too).

Every case whose family this zoo build has runs in float32 with full-precision matmuls (no TF32):
greedy tokens must equal `greedy_i` exactly, and full-depth logits (where the case stores
`logits_i`) must be within 1e-3 of the reference. Cases live in `tests/data/golden` of a checkout,
or wherever `LOOPSTACK_GOLDEN` points.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from hal.base import Hal
from hal.conformance.checks import SkipCheck

GOLDEN_ENV = "LOOPSTACK_GOLDEN"
LOGITS_TOLERANCE = 1e-3


def golden_dir() -> Path:
    env = os.environ.get(GOLDEN_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[1] / "tests" / "data" / "golden"


def _check_case(hal: Hal, case: Path, meta: dict) -> None:
    from safetensors.torch import load_file

    from runtime import LLM, SamplingParams

    tensors = load_file(str(case / "golden.safetensors"))
    llm = LLM(case, hal=hal, dtype="float32")
    prompts = [tensors[f"prompt_{i}"].tolist() for i in range(meta["num_prompts"])]
    num_loops = meta.get("greedy_num_steps")                  # Huginn's recurrences; None: model default
    # Huginn's golden used a zero initial state
    params = SamplingParams(max_tokens=meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True,
                            num_loops=num_loops, exit_threshold=1.0, init_scale=0.0)
    for i, out in enumerate(llm.generate(prompts, params)):
        want = tensors[f"greedy_{i}"].tolist()
        assert out.token_ids == want, f"{case.name} prompt {i}: greedy {out.token_ids} != golden {want}"
        ids = torch.tensor([prompts[i]], device=hal.device())
        expected = {num_loops: tensors[f"logits_{i}"]} if f"logits_{i}" in tensors else {}
        for key in (k for k in tensors if k.startswith(f"logits_{i}_steps")):   # Huginn: per recurrence count
            expected[int(key.rsplit("steps", 1)[1])] = tensors[key]
        for loops, want_logits in expected.items():
            kwargs = {"init_scale": 0.0} if llm.model.has_initial_state else {}
            with torch.no_grad():
                logits = llm.model(ids, num_loops=loops, **kwargs).logits[0]
            err = (logits.float().cpu() - want_logits).abs().max().item()
            assert err <= LOGITS_TOLERANCE, f"{case.name} prompt {i} ({loops} loops): logits error {err:.2e}"


def check_golden_greedy(hal: Hal) -> str:
    """Golden greedy tokens (and logits) through the runtime, float32, on this Hal."""
    import zoo

    root = golden_dir()
    cases = sorted(p for p in root.iterdir() if (p / "golden.json").is_file()) if root.is_dir() else []
    if not cases:
        raise SkipCheck(f"no golden cases at {root}; set {GOLDEN_ENV} to a golden folder "
                        f"(tests/data/golden in a loopstack checkout)")
    ran, missing = [], []
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")             # TF32 off: the golden is float32
    try:
        for case in cases:
            meta = json.loads((case / "golden.json").read_text())
            model_type = json.loads((case / "config.json").read_text()).get("model_type", "?")
            try:
                zoo.model_class(model_type)
            except (ImportError, zoo.CheckpointError):        # a family this zoo build does not have yet
                missing.append(case.name)
                continue
            _check_case(hal, case, meta)
            ran.append(case.name)
    finally:
        torch.set_float32_matmul_precision(precision)
    if not ran:
        raise SkipCheck(f"the zoo has none of the golden cases' families ({', '.join(missing)})")
    note = f" (family not in this zoo: {', '.join(missing)})" if missing else ""
    return f"{len(ran)} cases: {', '.join(ran)}{note}"


def main(argv: list[str]) -> int:
    from hal.conformance.__main__ import main as run_suite

    return run_suite(argv, extra={"golden_greedy": check_golden_greedy}, program="runtime.conformance")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
