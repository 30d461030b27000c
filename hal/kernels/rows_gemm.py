"""Decode projections of 9-128 rows on Hopper: a TMA-fed GEMM whose split-K partial products the
boundary after it sums (hal/kernels/norms.py reads them instead of the projection's output).

Why a GEMM of ours beside cuBLAS: at 64 rows cuBLAS streams Ouro-1.4B's o and down projections
at 1.4 and 2.1 TB/s, the down projection as a split-K kernel plus a `splitKreduce_kernel` of its
own, and none of its kernels takes part in PDL (docs/performance.md, levers 42, 53, 55). A
TMA-fed main loop reaches cuBLAS's rate (lever 55: o 5.70 against 6.35 us, down 9.25 against
11.89, partials summed apart); what lost every earlier attempt was the sum of the partials
(one program summing a tile's eight: +4 us). Here nothing in the GEMM sums them: the partials
`[S, M, N]` float32 go to the next `norm_add_norm`, which reads its row of each (from L2) in a
fixed order, rounds the sum to the output dtype as a GEMM's epilogue would, and goes on as
before: no reduction launch, deterministic. A down projection reads gate | up and applies
SwiGLU to its x tiles (the `silu_and_mul` launch goes), rounding as `silu_and_mul` does.

x and w reach shared memory through tensor descriptors (TMA); rows past M read zeros (the
descriptor's bounds), so any M up to BLOCK_M runs in one row tile.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.kernels.configs import KernelConfig
from hal.kernels.launch import Launch, launch_options
from hal.kernels.pdl import pdl_wait

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
MIN_ROWS = 9                 # fewer rows run the one-row / few-row kernels or cuBLAS (gemv_ops.MAX_ROWS = 8)
MAX_ROWS = 128               # two warpgroups of wgmma rows at most


@triton.jit
def _rows_gemm_kernel(out_ptr, x_desc, w_desc, num_rows, k_per_split, half_k, stride_split, stride_row,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      STAGES: tl.constexpr, SILU_MUL: tl.constexpr, PARTIALS: tl.constexpr,
                      DT: tl.constexpr, PDL: tl.constexpr = False):
    # grid (N / BLOCK_N, S): program (n, s) multiplies x[:, s-th K range] by w[n-th column block]
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_lo = pid_k * k_per_split
    pdl_wait(PDL)                                      # x is the kernel before's output
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(k_lo, k_lo + k_per_split, BLOCK_K, num_stages=STAGES):
        if SILU_MUL:                                   # x = gate | up, [M, 2K]
            gate = x_desc.load([0, k0]).to(tl.float32)
            up = x_desc.load([0, half_k + k0]).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32)      # torch rounds silu first
            a = (act * up).to(DT)
        else:
            a = x_desc.load([0, k0])                   # [BLOCK_M, BLOCK_K]
        w = w_desc.load([pid_n * BLOCK_N, k0])         # [BLOCK_N, BLOCK_K]
        acc = tl.dot(a, w.T, acc)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < num_rows)[:, None]
    if PARTIALS:
        tl.store(out_ptr + pid_k * stride_split + rows[:, None] * stride_row + cols[None, :], acc, mask=mask)
    else:
        tl.store(out_ptr + rows[:, None] * stride_row + cols[None, :], acc.to(DT), mask=mask)


def block_rows(rows: int) -> int:
    """The row tile for `rows` rows: 64 (one warpgroup of wgmma) or 128."""
    return 64 if rows <= 64 else 128


def takes(rows: int, n: int, k: int, config: KernelConfig) -> bool:
    """Whether `rows` x K @ K x N runs here with `config` (block_n columns, block_k, split_k)."""
    return (MIN_ROWS <= rows <= MAX_ROWS and n % config.block_n == 0
            and k % (config.block_k * max(config.split_k, 1)) == 0)


def rows_gemm_launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: KernelConfig, target: str,
                     silu_mul: bool = False) -> Launch:
    """`x: [M, K]` (or `[M, 2K]` gate | up with `silu_mul`) @ `weight: [N, K]`.T into `out`: `[M, N]` in
    x's dtype when `config.split_k` is 1, else `[S, M, N]` float32 partials."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = x.shape[0]
    n, k = weight.shape
    splits = max(config.split_k, 1)
    bm, bn, bk = block_rows(rows), config.block_n, config.block_k
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    partials = splits > 1
    stride_split = out.stride(0) if partials else 0
    stride_row = out.stride(-2)
    return Launch(_rows_gemm_kernel, (n // bn, splits), (
        out, x_desc, w_desc, rows, k // splits, k, stride_split, stride_row), dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=config.num_stages, SILU_MUL=silu_mul, PARTIALS=partials,
        DT=_TL_DTYPES[x.dtype], **launch_options(config, target)))
