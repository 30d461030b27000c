"""One-row projections through the vendor library: F.linear (with `out=`) against torch.mv, each under
cuBLAS and cuBLASLt, at Huginn-0125's, Nanbeige4.2-3B's and the lm_head shapes, on the GPU.

    PYTHONPATH=. python tools/one_row_blas_probe.py [rows.jsonl]

Why: docs/performance.md lever 82 (the twentieth session's call 4). Prints us per call (median of a
CUDA graph over enough weight copies to stream them from HBM), the copy-rate floor, and the largest
difference between mv's and F.linear's outputs.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_kernels_bench import FLOOR_BANDWIDTH, time_calls  # noqa: E402

SHAPES = {   # (name, N, K) of the one-row products the fused kernels do not take
    "nanbeige": (("qkv", 8192, 3072), ("o", 3072, 6144), ("gate_up", 21504, 3072), ("down", 3072, 10752),
                 ("lm_head", 166144, 3072)),
    "huginn": (("qkv", 15840, 5280), ("o", 5280, 5280), ("gate_up", 35840, 5280), ("down", 5280, 17920)),
    "ouro": (("lm_head", 49152, 2048),),
}


def main() -> int:
    out = open(sys.argv[1], "a") if len(sys.argv) > 1 else None
    for model, shapes in SHAPES.items():
        for name, n, k in shapes:
            copies = max(2, (400 << 20) // (n * k * 2))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
            y1 = torch.empty(n, device="cuda", dtype=torch.bfloat16)
            res = {}
            for library, suffix in (("cublas", ""), ("cublaslt", "_lt")):
                torch.backends.cuda.preferred_blas_library(library)
                res["linear" + suffix] = time_calls(
                    [lambda i=i: torch.nn.functional.linear(x, ws[i], out=y) for i in range(copies)])[0]
                res["mv" + suffix] = time_calls([lambda i=i: torch.mv(ws[i], x[0], out=y1) for i in range(copies)])[0]
            torch.backends.cuda.preferred_blas_library("cublas")
            diff = float((torch.mv(ws[0], x[0]).float() - torch.nn.functional.linear(x, ws[0])[0].float()).abs().max())
            floor = n * k * 2 / FLOOR_BANDWIDTH * 1e6
            print(f"GEMV {model:9s} {name:8s} floor {floor:6.1f} "
                  + " ".join(f"{key} {us:6.1f}" for key, us in res.items()) + f" diff {diff:.3g}", flush=True)
            if out:
                out.write(json.dumps({"model": model, "shape": name, "floor_us": floor, **res, "mv_diff": diff}) + "\n")
            del ws
    return 0


if __name__ == "__main__":
    sys.exit(main())
