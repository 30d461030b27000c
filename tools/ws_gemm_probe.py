"""A probe for the next form of the batch-64 projection lever (docs/performance.md, lever 53): does a
warp-specialised, TMA-fed Triton GEMM (Triton 3.6 on sm_90: `tl.range(..., warp_specialize=True)`
over host tensor descriptors; a producer warp feeds shared memory, consumer warp groups multiply)
stream Ouro-1.4B's projections at 64 rows faster than cuBLAS? Times the main kernel alone (split-K
partials to an fp32 `[S, M, N]` workspace; the sum over S is timed apart as a torch reduction), in a
CUDA graph over enough weight copies to defeat the 60 MB L2, against `F.linear`.

    PYTHONPATH=. python tools/ws_gemm_probe.py [--out rows.jsonl]
"""
from __future__ import annotations

import argparse
import sys

from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from decode_kernels_bench import time_calls  # noqa: E402
from runtime.bench_rows import append_rows  # noqa: E402

SHAPES = {"qkv": (6144, 2048), "o": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632)}
ROWS = 64
FLOOR_BANDWIDTH = 4.27e12


@triton.jit
def _ws_kernel(part_ptr, x_desc, w_desc, M, N, k_per_split, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
               STAGES: tl.constexpr, WS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_lo = pid_k * k_per_split
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in tl.range(k_lo, k_lo + k_per_split, BK, num_stages=STAGES, warp_specialize=WS):
        a = x_desc.load([0, k0])                      # [BM, BK]
        w = w_desc.load([pid_n * BN, k0])             # [BN, BK]
        acc = tl.dot(a, w.T, acc)
    rows = tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    tl.store(part_ptr + pid_k * M * N + rows[:, None] * N + cols[None, :], acc, mask=(rows < M)[:, None])


def _graph_time(fn, copies: int) -> float:
    """Median us per call of `fn(0) .. fn(copies - 1)` replayed in one CUDA graph."""
    return time_calls([lambda i=i: fn(i) for i in range(copies)])[0]


def main() -> int:
    from triton.tools.tensor_descriptor import TensorDescriptor

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    tiles = ((128, 64, 6, 4, True), (128, 128, 3, 4, True), (64, 128, 6, 4, True), (64, 64, 8, 4, True),
             (256, 64, 4, 8, True), (128, 64, 6, 4, False))         # (block_n, block_k, stages, warps, ws)
    splits = {"qkv": (1, 2, 4), "o": (2, 4, 8), "gate_up": (1, 2), "down": (2, 4, 8)}
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, (200 << 20) // (n * k * 2))
        ws_ = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(ROWS, n, device="cuda", dtype=torch.bfloat16)
        ref = (x.float() @ ws_[0].float().T)
        floor = n * k * 2 / FLOOR_BANDWIDTH * 1e6
        us = _graph_time(lambda i: torch.nn.functional.linear(x, ws_[i], out=out), copies)
        rows.append({"shape": name, "variant": "cublas", "us": us, "floor_us": floor})
        print(f"{name:8s} cublas {us:7.2f} us  floor {floor:5.2f}", flush=True)
        for (bn, bk, st, warps, ws), split in ((t, sp) for t in tiles for sp in splits[name]):
            if k % (bk * split) or n % bn:
                continue
            kps = k // split
            part = torch.empty(split, ROWS, n, device="cuda", dtype=torch.float32)
            xd = TensorDescriptor.from_tensor(x, [ROWS, bk])
            wds = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws_]
            label = f"ws{int(ws)} n{bn} k{bk} s{st} w{warps} split{split}"

            def launch(i, wds=wds, xd=xd, part=part, bn=bn, bk=bk, st=st, warps=warps, ws=ws, kps=kps, split=split):
                _ws_kernel[(n // bn, split)](part, xd, wds[i], ROWS, n, kps, BM=ROWS, BN=bn, BK=bk, STAGES=st, WS=ws,
                                             num_warps=warps)
            try:
                launch(0)
                err = float((part.sum(0) - ref).norm() / ref.norm())
                t = _graph_time(launch, copies)
                summed = torch.empty_like(ref)              # (not ref: the check of the next config reads it)
                t_sum = _graph_time(lambda i: torch.sum(part, 0, out=summed), 1) if split > 1 else 0.0
            except Exception as e:  # noqa: BLE001 (a config that does not compile or launch is a finding)
                print(f"{name:8s} {label:32s} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            rows.append({"shape": name, "variant": label, "us": t, "sum_us": t_sum, "floor_us": floor, "rel_err": err})
            print(f"{name:8s} {label:32s} {t:7.2f} us (+ sum {t_sum:5.2f})  {n * k * 2 / t / 1e6:5.2f} TB/s  err {err:.1e}",
                  flush=True)
        del ws_
    append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
