"""Does cuBLAS stream a projection faster from a K-major weight (`[K, N]`: `x @ Wt`, `torch.mv`) than
from the `[N, K]` layout `F.linear` takes? On the GPU.

    PYTHONPATH=. python tools/weight_layout_probe.py [rows.jsonl]

Why: docs/performance.md lever 92 (the twenty-fourth session's call 4): one row at Nanbeige4.2-3B's and
Huginn-0125's narrow projections (cuBLAS splits K there), 64 and 128 rows at Ouro-1.4B's. Each shape
runs over about 2 GB of distinct weights in one CUDA graph (`decode_kernels_bench.time_calls`); prints
us per call and TB/s.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_kernels_bench import FLOOR_BANDWIDTH, time_calls  # noqa: E402

F = torch.nn.functional
CASES = (   # (model, rows, projection, N, K)
    ("nanbeige", 1, "o", 3072, 6144), ("nanbeige", 1, "down", 3072, 10752), ("nanbeige", 1, "qkv", 8192, 3072),
    ("nanbeige", 1, "gate_up", 21504, 3072), ("huginn", 1, "down", 5280, 17920), ("huginn", 1, "o", 5280, 5280),
    ("ouro", 64, "qkv", 6144, 2048), ("ouro", 64, "o", 2048, 2048), ("ouro", 64, "gate_up", 11264, 2048),
    ("ouro", 64, "down", 2048, 5632), ("ouro", 128, "gate_up", 11264, 2048), ("ouro", 128, "down", 2048, 5632))


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 else None
    for model, rows, name, n, k in CASES:
        copies = max(8, int(2e9 // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        products = {"linear_nk": [lambda w=w: F.linear(x, w) for w in ws],
                    "matmul_kn": [lambda wt=wt: torch.matmul(x, wt) for wt in wts]}
        if rows == 1:
            products["mv_kn"] = [lambda wt=wt: torch.mv(wt.t(), x[0]) for wt in wts]
            products["mv_nk"] = [lambda w=w: torch.mv(w, x[0]) for w in ws]
        ref = None
        for label, fns in products.items():
            us = time_calls(fns, replays=20)[0]
            y = fns[-1]().float().reshape(-1)
            ref = y if ref is None else ref
            row = dict(model=model, rows=rows, shape=name, n=n, k=k, variant=label, us=round(us, 2),
                       tb_s=round(n * k * 2 / us / 1e6, 3),
                       floor_us=round(n * k * 2 / FLOOR_BANDWIDTH * 1e6, 2), rel=float((y - ref).norm() / ref.norm()))
            print(f"{model:8s} {rows:3d} rows {name:7s} {label:10s} {us:7.2f} us {row['tb_s']:.2f} TB/s "
                  f"floor {row['floor_us']:.1f}", flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
