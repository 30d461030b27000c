"""Nsight Compute on the decode-batch projections at 64 rows (lever 53): cuBLAS against the tl.dot
path of hal/kernels/gemv.py in two configs, on Ouro-1.4B's o and down shapes, three launches each.
`tools/gpu_check.sh rows` runs it under `ncu --clock-control none` to name what holds each kernel.

    PYTHONPATH=. python tools/rows_gemm_ncu.py
"""
from __future__ import annotations

import torch

from hal.kernels.configs import KernelConfig
from hal.kernels.gemv import gemv_launch
from hal.kernels.launch import run_launch

SHAPES = {"o": (2048, 2048), "down": (2048, 5632)}
CONFIGS = (KernelConfig(16, 64, 4, 4, block_k=128, split_k=0), KernelConfig(16, 128, 8, 2, block_k=256, split_k=0))


def main() -> None:
    dev = torch.device("cuda")
    units = torch.cuda.get_device_properties(0).multi_processor_count
    counters = torch.zeros(1 << 16, dtype=torch.int32, device=dev)
    workspace = torch.empty(16 * 64 * 16384, dtype=torch.float32, device=dev)
    for name, (n, k) in SHAPES.items():
        ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        x = torch.randn(64, k, device=dev, dtype=torch.bfloat16)
        out = torch.empty(64, n, device=dev, dtype=torch.bfloat16)
        for w in ws:
            torch.nn.functional.linear(x, w, out=out)
        for config in CONFIGS:
            for w in ws:
                run_launch(gemv_launch(x, w, out, config, "cuda", units, workspace=workspace, counters=counters))
        torch.cuda.synchronize()
        print(name, "done", flush=True)


if __name__ == "__main__":
    main()
