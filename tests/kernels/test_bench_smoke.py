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
            "rotary (neox)", "silu_and_mul", "kv_write"} <= kernels
    errors = [float(r["note"].split("max err ")[1].split()[0]) for r in rows if "max err" in r["note"]]
    assert errors and max(errors) < 3e-2, rows          # the bench checks attention against the reference
    assert any(line.startswith("# best for") for line in lines)
