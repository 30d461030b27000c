"""The row-stream decode kernel (hal/kernels/row_decode.py) at 128 x 1K in the sm_90 table's configs,
three launches per case: FP8 at head dim 128, bf16 at 128, and bf16 at head dim 64 (128 bytes per key
and head, as FP8 at 128: lever 49). `tools/gpu_check.sh ncurow` runs it under Nsight Compute
(`ncu --clock-control none`, every launch from the third FP8 one on) to name what holds each kernel:
DRAM share, issue activity, pipes, stall reasons, L2 requests (docs/performance.md, levers 47, 49).

    PYTHONPATH=. python tools/row_decode_ncu.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fp8_kernels_bench import _attend, _paged  # noqa: E402

from hal.kernels.row_decode import row_decode_launches  # noqa: E402


def main() -> None:
    device = torch.device("cuda")
    cases = ((torch.float8_e4m3fn, "attention_row_decode_fp8", 128), (None, "attention_row_decode", 128),
             (None, "attention_row_decode", 64))
    for kv_dtype, key, head_dim in cases:
        backend, batch, cache, q = _paged(device, 128, 1025, 2, kv_dtype, head_dim=head_dim)
        meta = backend.build_meta(batch)
        values, scales = backend._views(cache)
        out = torch.empty_like(q)
        for _ in range(3):
            _attend(row_decode_launches, q, values, scales, meta, 0, head_dim ** -0.5, backend.configs[key], 1,
                    backend.configs["attention_reduce"], out)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
