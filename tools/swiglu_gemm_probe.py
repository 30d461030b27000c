"""Prefill's gate|up projection + SwiGLU: cuBLAS then `silu_and_mul` against hal/kernels/swiglu_gemm.py
(SwiGLU in the GEMM's epilogue), at Ouro-1.4B's shape and several prompt lengths, on the GPU.

    PYTHONPATH=. python tools/swiglu_gemm_probe.py [--rows 8192 2048] [--out rows.jsonl]

Why: docs/performance.md lever 81. Prints us per call (median of a CUDA graph over `copies` weight
copies, so the weights come from HBM as in a layer stack), TFLOP/s of the product, and how many
outputs differ from the cuBLAS path's (a different summation order: an ulp here and there).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from hal.kernels.configs import KernelConfig, configs_for
from hal.kernels.launch import run_launch
from hal.kernels.ops import silu_and_mul
from hal.kernels.swiglu_gemm import swiglu_gemm_launch

sys.path.insert(0, str(Path(__file__).parent))
from decode_kernels_bench import time_calls  # noqa: E402

HIDDEN, INTERMEDIATE = 2048, 5632
# (block_m, block_n, block_k, stages, warps, warp-specialised K loop, persistent); call 2 of the
# twentieth session ran the persistent ones without specialisation: 128 x 128 x 64 at 3-4 stages
# and 8 warps best (592-595 TFLOP/s at 8,192 rows), 128 x 64 at 4 warps 290, 64 x 128 386
CONFIGS = ((128, 128, 64, 3, 8, False, True), (128, 128, 64, 3, 8, False, False), (128, 128, 64, 4, 8, False, False),
           (128, 128, 128, 2, 8, False, False), (64, 128, 64, 4, 4, True, False), (64, 128, 64, 3, 4, True, False),
           (64, 128, 64, 5, 4, True, False), (64, 128, 128, 3, 4, True, False), (64, 256, 64, 3, 4, True, False))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="*", default=[8192, 4096, 1024])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    configs = configs_for("sm_90")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copies = 4
    ws = [torch.randn(2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16) * HIDDEN ** -0.5
          for _ in range(copies)]
    rows_out = []
    for rows in args.rows:
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        flops = 2 * rows * HIDDEN * 2 * INTERMEDIATE
        gu = torch.empty(rows, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
        ref = silu_and_mul(torch.nn.functional.linear(x, ws[0]), configs)

        def cublas(i):
            torch.nn.functional.linear(x, ws[i], out=gu)
            return silu_and_mul(gu, configs)
        us_gemm, _ = time_calls([lambda i=i: torch.nn.functional.linear(x, ws[i], out=gu) for i in range(copies)])
        us, _ = time_calls([lambda i=i: cublas(i) for i in range(copies)])
        print(f"SWIGLU rows {rows:5d} cublas gemm {us_gemm:8.1f} us ({flops / us_gemm / 1e6:5.0f} TFLOP/s), "
              f"+ silu_and_mul {us:8.1f} us", flush=True)
        rows_out.append({"rows": rows, "variant": "cublas", "us": us, "gemm_us": us_gemm})
        out = torch.empty(rows, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
        for bm, bn, bk, st, warps, spec, persistent in CONFIGS:
            config = KernelConfig(bm, bn, warps, st, block_k=bk)
            label = f"m{bm} n{bn} k{bk} s{st} w{warps}{' ws' if spec else ''}{' pers' if persistent else ''}"
            try:
                launches = [swiglu_gemm_launch(x, w, out, config, "cuda", sms, ws=spec, persistent=persistent)
                            for w in ws]
                run_launch(launches[0])
                torch.cuda.synchronize()
                diff = float((out.float() - ref.float()).abs().max())
                differ = float((out != ref).float().mean())
                t, _ = time_calls([lambda la=la: run_launch(la) for la in launches])
            except Exception as e:  # noqa: BLE001 (a config that does not compile or launch is a finding)
                print(f"SWIGLU rows {rows:5d} {label:24s} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            rows_out.append({"rows": rows, "variant": label, "us": t, "max_diff": diff, "differ": differ})
            print(f"SWIGLU rows {rows:5d} {label:24s} {t:8.1f} us ({flops / t / 1e6:5.0f} TFLOP/s) "
                  f"{us / t:5.3f}x cuBLAS+silu  differ {differ:.4f} max {diff:.3g}", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows_out:
                f.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
