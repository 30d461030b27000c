"""One-row projections one shape at a time: cuBLAS against gemv.py's K-looping kernel and the
whole-slice kernel (gemv_slice.py) over a grid of configs, PDL on, on the GPU.

    PYTHONPATH=. python tools/one_row_sweep.py [--model nanbeige4.2-3b] [--shapes o down] [--out rows.jsonl]

Why: docs/performance.md lever 91 (the twenty-fourth session's call 2). Each shape runs over as many
distinct weights as a layer count of the model (so they stream from HBM) in one CUDA graph, every
launch reading the same x (`tools/pdl_bench.py --shape` runs one shape too, on fewer configs).
Alone a kernel that preloads its weights under the launch before it can win; lever 91 lost the same
configs in the engine, where the launch before o is attention: time candidates there too.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from pdl_bench import (FLOOR_BANDWIDTH, MODEL_SHAPES, cublas_launch, gemv_launcher,  # noqa: E402
                       slice_gemv_launcher, time_graph)

from hal.kernels.configs import KernelConfig  # noqa: E402
from runtime.bench_rows import append_rows  # noqa: E402

# gemv.py's K loop: (block_n, block_k, warps, stages, split_k; 0 = gemv.plan's rule)
LOOP_CONFIGS = ((16, 256, 4, 2, 0), (16, 256, 4, 2, 4), (16, 256, 4, 2, 8), (8, 512, 4, 2, 0),
                (8, 512, 4, 2, 4), (8, 512, 4, 2, 8), (16, 512, 4, 2, 4), (16, 512, 8, 2, 4),
                (32, 256, 4, 2, 4), (32, 256, 8, 2, 2), (8, 256, 2, 2, 8), (4, 512, 2, 2, 8),
                (8, 1024, 4, 2, 4), (16, 128, 4, 2, 8), (16, 256, 4, 1, 4))
# the slice kernel: (block_n, slice of K, warps)
SLICE_CONFIGS = ((4, 2048, 4), (2, 2048, 2), (8, 1024, 4), (4, 1024, 2), (16, 512, 4), (2, 4096, 4))
LAYERS = {"ouro-1.4b": 24, "huginn-0125": 4, "nanbeige4.2-3b": 22}


def variants() -> list:
    out = [("cublas", cublas_launch)]
    out += [(f"loop n{bn} k{bk} w{w} s{s} sk{sk} pdl",
             gemv_launcher(True, KernelConfig(1, bn, w, s, block_k=bk, split_k=sk)))
            for bn, bk, w, s, sk in LOOP_CONFIGS]
    out += [(f"slice n{bn} k{bk} w{w} pdl", slice_gemv_launcher(True, KernelConfig(1, bn, w, 1, block_k=bk)))
            for bn, bk, w in SLICE_CONFIGS]
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODEL_SHAPES), default="nanbeige4.2-3b")
    p.add_argument("--shapes", nargs="*", default=None, help="projection names (default: all four)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    layers = LAYERS[args.model]
    for name, n, k in MODEL_SHAPES[args.model]:
        if args.shapes and name not in args.shapes:
            continue
        torch.manual_seed(0)
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(layers)]
        x0 = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        floor = n * k * 2 / FLOOR_BANDWIDTH * 1e6
        ref = None
        for label, launch in variants():
            try:
                us, y = time_graph(launch, weights, x0, independent=True)
            except Exception as e:  # noqa: BLE001 (a config that fails to compile is reported)
                print(f"{name:7s} {label:32s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            ref = y if ref is None else ref
            per = us / layers
            row = dict(model=args.model, shape=name, n=n, k=k, variant=label, us=round(per, 2),
                       floor_us=round(floor, 2), tb_s=round(n * k * 2 / per / 1e6, 3),
                       rel_vs_cublas=float((y.float() - ref.float()).norm() / ref.float().norm()))
            print(f"{name:7s} {label:32s} {per:7.2f} us  {row['tb_s']:.2f} TB/s  floor {floor:.1f}", flush=True)
            append_rows(args.out, [row])
    return 0


if __name__ == "__main__":
    sys.exit(main())
