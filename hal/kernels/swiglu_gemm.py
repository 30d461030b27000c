"""Prefill's gate|up projection with SwiGLU in its epilogue, on Hopper: `silu(x @ W_gate.T) * (x @ W_up.T)`
from the fused `[2I, K]` gate | up matrix, without the `[T, 2I]` product ever reaching memory.

Why: in an 8,192-token Ouro-1.4B prefill the `silu_and_mul` launches take 6.4 ms of 182 (96 launches
of 276 MB each, at the copy rate): the product is written, read back and halved. Here each program
holds a gate tile and the up tile of the same columns (two accumulators over one x tile), rounds
each as the GEMM's output would be rounded, and writes `silu(gate) * up` as `silu_and_mul` rounds it.
It pays only if the main loop keeps cuBLAS's rate (about 750 TFLOP/s at these shapes): at 87% of
it the launch saved is spent again.

Tiles reach shared memory through tensor descriptors (TMA), rows past T read zeros; programs
walk the output tiles persistently (one per SM), M-blocks grouped so that a group's weight columns
stay in L2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.kernels.configs import KernelConfig
from hal.kernels.launch import Launch, launch_options

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
GROUP_M = 8


@triton.jit
def _swiglu_tile(tile, out_desc, x_desc, w_desc, num_m, num_n, half_n, steps, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, GROUP: tl.constexpr,
                 DT: tl.constexpr, WS: tl.constexpr):
    per_group = GROUP * num_n                          # M-blocks in groups: their columns stay in L2
    first_m = (tile // per_group) * GROUP
    group = tl.minimum(num_m - first_m, GROUP)
    pid_m = first_m + (tile % per_group) % group
    pid_n = (tile % per_group) // group
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in tl.range(0, steps, num_stages=STAGES, warp_specialize=WS):
        k0 = s * BLOCK_K
        a = x_desc.load([pid_m * BLOCK_M, k0])                       # [BLOCK_M, BLOCK_K]
        w_gate = w_desc.load([pid_n * BLOCK_N, k0])                  # [BLOCK_N, BLOCK_K]
        w_up = w_desc.load([half_n + pid_n * BLOCK_N, k0])
        gate = tl.dot(a, w_gate.T, gate)
        up = tl.dot(a, w_up.T, up)
    g = gate.to(DT).to(tl.float32)                                  # the product's dtype, as F.linear
    act = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)           # torch rounds silu first
    out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], (act * up.to(DT).to(tl.float32)).to(DT))


@triton.jit
def _swiglu_gemm_kernel(out_desc, x_desc, w_desc, num_rows, half_n, k,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        STAGES: tl.constexpr, NUM_PROGRAMS: tl.constexpr, GROUP: tl.constexpr,
                        DT: tl.constexpr, WS: tl.constexpr = False, PERSISTENT: tl.constexpr = True):
    num_m = tl.cdiv(num_rows, BLOCK_M)
    num_n = half_n // BLOCK_N
    steps = tl.cdiv(k, BLOCK_K)
    if PERSISTENT:                                     # one program per SM walks the tiles
        for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=True):
            _swiglu_tile(tile, out_desc, x_desc, w_desc, num_m, num_n, half_n, steps, BLOCK_M, BLOCK_N, BLOCK_K,
                         STAGES, GROUP, DT, WS)
    else:
        _swiglu_tile(tl.program_id(0), out_desc, x_desc, w_desc, num_m, num_n, half_n, steps, BLOCK_M, BLOCK_N,
                     BLOCK_K, STAGES, GROUP, DT, WS)


def swiglu_gemm_launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: KernelConfig,
                       target: str, num_programs: int, ws: bool = False, persistent: bool = True) -> Launch:
    """`x: [T, K]` @ `weight: [2I, K]` (gate | up).T -> `out: [T, I]` = silu(gate) * up, in x's dtype;
    `num_programs` persistent programs (the SM count)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows, k = x.shape
    half_n = weight.shape[0] // 2
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    tiles = triton.cdiv(rows, bm) * (half_n // bn)
    programs = max(1, min(num_programs, tiles)) if persistent else tiles
    return Launch(_swiglu_gemm_kernel, (programs,), (
        TensorDescriptor.from_tensor(out, [bm, bn]), TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(weight, [bn, bk]), rows, half_n, k), dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=config.num_stages, NUM_PROGRAMS=programs, GROUP=GROUP_M,
        DT=_TL_DTYPES[x.dtype], WS=ws, PERSISTENT=persistent, **launch_options(config, target)))


def takes(rows: int, half_n: int, k: int, config: KernelConfig) -> bool:
    """Whether the kernel takes `rows` x K @ K x 2I with `config` (whole column and K tiles)."""
    return rows > 0 and half_n % config.block_n == 0 and k % config.block_k == 0
