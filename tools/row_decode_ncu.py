"""The row-stream decode kernel (hal/kernels/row_decode.py) at 128 x 1K, FP8 and bf16 caches in the
sm_90 table's configs, three launches each: the workload `tools/gpu_check.sh ncurow` runs under
Nsight Compute (`ncu --clock-control none`, the third FP8 and the first bf16 launch) to name what
holds each kernel: DRAM share, issue activity, pipes, stall reasons (docs/performance.md, lever 47).

    PYTHONPATH=. python tools/row_decode_ncu.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fp8_kernels_bench import _paged  # noqa: E402

from hal.kernels.launch import run_launch  # noqa: E402
from hal.kernels.row_decode import row_decode_launches  # noqa: E402


def main() -> None:
    device = torch.device("cuda")
    for kv_dtype, key in ((torch.float8_e4m3fn, "attention_row_decode_fp8"), (None, "attention_row_decode")):
        backend, batch, cache, q = _paged(device, 128, 1025, 2, kv_dtype)
        meta = backend.build_meta(batch)
        values, scales = backend._views(cache)
        out = torch.empty_like(q)
        for _ in range(3):
            for launch in row_decode_launches(q, values, meta.block_tables[0], meta.seq_lens, meta.query_start_loc,
                                              128 ** -0.5, backend.configs[key], 1, backend.configs["attention_reduce"],
                                              out, "cuda", scales):
                run_launch(launch)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
