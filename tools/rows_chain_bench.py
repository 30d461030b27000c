"""The batch-64 projections after attention, as the engine chains them, on the GPU: cuBLAS against
hal/kernels/rows_gemm.py (split-K partials summed by the `norm_add_norm` after them).

    PYTHONPATH=. python tools/rows_chain_bench.py [--rows 64] [--layers 24] [--out rows.jsonl]

Why: docs/performance.md lever 80. Per layer and loop the decode step runs, after attention,
`o -> norm_add_norm -> gate|up -> silu_and_mul -> down -> norm_add_norm` (Ouro-1.4B's sandwich
boundaries); the variants replace o and down (and optionally gate|up) with the TMA GEMM, down
taking SwiGLU in its x tiles. One CUDA graph replays `layers` layers with their own weights (the
weights stream from HBM as in the engine); each layer reads the stream the one before wrote.
Prints us per layer for each variant and the largest difference of the final stream to the cuBLAS
chain's (different summation orders: bf16 roundings apart, not wrong values).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from hal.base import Partials
from hal.kernels.configs import KernelConfig, configs_for
from hal.kernels.launch import run_launch
from hal.kernels.norms import norm_add_norm
from hal.kernels.ops import silu_and_mul
from hal.kernels.rows_gemm import rows_gemm_launch

HIDDEN, INTERMEDIATE, EPS = 2048, 5632, 1e-6
FLOOR_BANDWIDTH = 4.27e12
# (block_n, block_k, stages, warps, split_k)
O_CONFIGS = ((128, 64, 6, 4, 8), (128, 64, 6, 4, 4), (64, 64, 8, 4, 4), (256, 64, 4, 8, 8), (64, 128, 6, 4, 4))
DOWN_CONFIGS = ((128, 64, 6, 4, 8), (128, 64, 6, 4, 4), (64, 64, 8, 4, 4), (256, 64, 4, 8, 8), (64, 128, 6, 4, 4),
                (128, 128, 3, 4, 8))
GATE_UP_CONFIGS = ((128, 64, 6, 4, 1), (64, 64, 8, 4, 1), (128, 128, 3, 4, 1))


def _config(c) -> KernelConfig:
    bn, bk, stages, warps, split = c
    return KernelConfig(1, bn, warps, stages, block_k=bk, split_k=split)


class Layer:
    def __init__(self, rows: int) -> None:
        def w(n, k):
            return torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        self.o, self.gate_up, self.down = w(HIDDEN, HIDDEN), w(2 * INTERMEDIATE, HIDDEN), w(HIDDEN, INTERMEDIATE)
        self.norms = [torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(4)]


def _project(x, w, config, silu_mul=False):
    """x @ w.T through rows_gemm: Partials (split_k > 1) or the bf16 output."""
    rows, n = x.shape[0], w.shape[0]
    if config.split_k > 1:
        parts = torch.empty(config.split_k, rows, n, device="cuda", dtype=torch.float32)
        run_launch(rows_gemm_launch(x, w, parts, config, "cuda", silu_mul=silu_mul))
        return Partials(parts, torch.Size([rows, n]), x.dtype)
    out = torch.empty(rows, n, device="cuda", dtype=x.dtype)
    run_launch(rows_gemm_launch(x, w, out, config, "cuda", silu_mul=silu_mul))
    return out


def chain(layers, a, h, o_cfg=None, gu_cfg=None, down_cfg=None, configs=None):
    """The post-attention half of each layer; `a` stands for attention's output (the stream's norm)."""
    for layer in layers:
        pa, nm, pm, nn_ = layer.norms
        o = torch.nn.functional.linear(a, layer.o) if o_cfg is None else _project(a, layer.o, o_cfg)
        n, h = norm_add_norm(o, h, pa, nm, EPS, configs=configs)
        gu = torch.nn.functional.linear(n, layer.gate_up) if gu_cfg is None else _project(n, layer.gate_up, gu_cfg)
        if down_cfg is None:
            d = torch.nn.functional.linear(silu_and_mul(gu, configs), layer.down)
        else:
            d = _project(gu, layer.down, down_cfg, silu_mul=True)
        a, h = norm_add_norm(d, h, pm, nn_, EPS, configs=configs)
    return a, h


def time_chain(layers, a0, h0, replays=20, **kw) -> tuple[float, torch.Tensor]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            chain(layers, a0, h0, **kw)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, _ = chain(layers, a0, h0, **kw)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(layers))
    times.sort()
    return times[len(times) // 2], out.float().clone()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    configs = configs_for("sm_90")
    layers = [Layer(args.rows) for _ in range(args.layers)]
    a0 = torch.randn(args.rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    h0 = torch.randn(args.rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    bytes_per_layer = 2 * (HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE)
    floor = bytes_per_layer / FLOOR_BANDWIDTH * 1e6
    rows = []

    def run(label, **kw):
        try:
            us, out = time_chain(layers, a0, h0, configs=configs, **kw)
        except Exception as e:  # noqa: BLE001 (a config that does not compile or launch is a finding)
            print(f"CHAIN {label:44s} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
            return None
        diff = float((out - ref).abs().max()) if ref is not None else 0.0
        rows.append({"rows": args.rows, "variant": label, "us_per_layer": us, "floor_us": floor, "max_diff": diff})
        print(f"CHAIN {label:44s} {us:7.2f} us/layer ({floor / us:4.2f} of floor)  diff {diff:.3g}", flush=True)
        return us, out

    ref = None
    _, ref = run("cublas")
    best_o = best_d = None
    for c in DOWN_CONFIGS:
        r = run(f"down {c}", down_cfg=_config(c))
        if r and (best_d is None or r[0] < best_d[0]):
            best_d = (r[0], c)
    for c in O_CONFIGS:
        r = run(f"o {c}", o_cfg=_config(c))
        if r and (best_o is None or r[0] < best_o[0]):
            best_o = (r[0], c)
    if best_o and best_d:
        run(f"o {best_o[1]} + down {best_d[1]}", o_cfg=_config(best_o[1]), down_cfg=_config(best_d[1]))
        for c in GATE_UP_CONFIGS:
            run(f"all, gate|up {c}", o_cfg=_config(best_o[1]), down_cfg=_config(best_d[1]), gu_cfg=_config(c))
    run("cublas again")
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
