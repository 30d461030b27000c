"""The one-row decode projection that holds its whole weight slice before it waits for its input:
`y = prologue(x) @ W.T (+ residual)` for M = 1, W `[N, K]`, with programmatic dependent launch.

Why: at batch 1 a projection streams its weight once, and with PDL (hal/kernels/pdl.py) a kernel
may start while the one before it still runs. A program here loads its `[BLOCK_N, KS]` slice of W
(all of K up to KS) into registers first, then waits for the previous kernel, then reads x and
sums: the weight bytes of the next projection are in flight while the kernel before it (and its
tail) finishes. One slice per program also drops the K loop and, for K <= KS, the split-K sum.
Measured (H200, `tools/pdl_bench.py --quick`, 24 layers of Ouro-1.4B's four projections in one
graph, 2026-12-02): 4 x 2048 slices on 4 warps 32.1 us per layer with PDL, 37.4 without, cuBLAS
41.1; the K-looping kernel of gemv.py 47-51 us.

Prologues and the residual epilogue are gemv.py's (`PROLOGUE`, `ADD_RESIDUAL`, the same device
functions, so the same rounding). K > KS splits into `cdiv(K, KS)` programs per column block whose
fp32 partials the last to arrive sums in split order (deterministic, as in gemv.py). FP8 weights
(`W_SCALED`) widen in registers; the per-column scale multiplies the sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.kernels import gemv
from hal.kernels.configs import KernelConfig
from hal.kernels.gemv import _finish
from hal.kernels.gemv_prologue import NONE, SILU_AND_MUL, _input_tile, _row_stats
from hal.kernels.launch import Launch, launch_options, next_pow2
from hal.kernels.pdl import pdl_wait


@triton.jit
def _slice_gemv_kernel(out_ptr, x_ptr, w_ptr, res_ptr, stream_ptr, in_norm_ptr, res_norm_ptr, out_res_ptr,
                       part_ptr, count_ptr, w_scale_ptr, N, K, eps, stride_wn,
                       PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                       KS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                       STATS_BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, W_SCALED: tl.constexpr,
                       PDL: tl.constexpr = False):
    """out `[1, N]` = prologue(x) `[1, K]` @ w `[N, K]`.T (+ out_res). Grid `(cdiv(N, BLOCK_N), SPLIT_K)`;
    split-K partials go to part `[SPLIT_K, N]` fp32."""
    DT = out_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = pid_k * KS + tl.arange(0, KS)
    k_mask = ks < K
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    if EVEN_N and EVEN_K:      # no mask: the loads stay 16-byte vectors
        w = tl.load(w_ptrs)
    elif EVEN_K:
        w = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0)
    else:
        w = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
    pdl_wait(PDL)             # the slice is in flight; x and the outputs belong to the kernels around
    rows = tl.arange(0, 1)
    row_mask = rows < 1
    inv_src = tl.zeros([1], tl.float32)
    inv_stream = inv_src
    if PROLOGUE == 1 or PROLOGUE >= 3:
        inv_src, inv_stream = _row_stats(x_ptr, res_ptr, res_norm_ptr, rows, row_mask, K, eps, 0, 0,
                                         PROLOGUE, 1, STATS_BLOCK, ONE_PASS, DT)
    a = _input_tile(x_ptr, res_ptr, in_norm_ptr, res_norm_ptr, stream_ptr, rows, row_mask, ks, k_mask, K,
                    inv_src, inv_stream, tl.where(pid_n == 0, 1, 0), 0, 0, 0, PROLOGUE, DT)   # [1, KS]
    acc = tl.sum(w.to(tl.float32) * a.to(tl.float32), 1)[None, :]                     # [1, BLOCK_N]
    _finish(acc, out_ptr, out_res_ptr, part_ptr, count_ptr, w_scale_ptr, rows, cols, row_mask, col_mask, 1, N,
            pid_n, pid_k, 0, 0, ADD_RESIDUAL, SPLIT_K, W_SCALED, 1, BLOCK_N, DT)


def num_splits(k: int, config: KernelConfig) -> int:
    """Programs per column block: K in slices of `config.block_k`."""
    return -(-k // config.block_k)


def slice_gemv_launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: KernelConfig,
                      target: str, *, prologue: int = NONE, eps: float = 0.0,
                      norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                      res_norm_weight: torch.Tensor | None = None, stream_out: torch.Tensor | None = None,
                      out_residual: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                      counters: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None) -> Launch:
    """The launch of `out [1, N] = prologue(x) @ weight.T (+ out_residual)`; x `[1, K]` (`[1, 2K]` for
    SILU_AND_MUL), weight `[N, K]` with unit stride along K, all vectors contiguous. `config.block_n`
    columns and `config.block_k` (a power of two) of K per program; K > block_k needs `workspace`
    (>= splits * N float32) and `counters` (int32 zeros, >= cdiv(N, block_n))."""
    rows, n = out.shape
    k = weight.shape[1]
    if rows != 1:
        raise ValueError(f"the slice gemv takes one row, got {rows}")
    if config.block_k != next_pow2(config.block_k):
        raise ValueError(f"gemv_slice's block_k must be a power of two, got {config.block_k}")
    split = num_splits(k, config)
    if split > 1 and (workspace is None or counters is None):
        raise ValueError("a split-K slice gemv needs a workspace and counters")
    return Launch(_slice_gemv_kernel, (-(-n // config.block_n), split), (
        out, x, weight, residual if residual is not None else x, stream_out if stream_out is not None else out,
        norm_weight if norm_weight is not None else weight,
        res_norm_weight if res_norm_weight is not None else weight,
        out_residual if out_residual is not None else out, workspace if workspace is not None else out,
        counters if counters is not None else out, weight_scale if weight_scale is not None else out,
        n, k, eps, weight.stride(0)), dict(
        PROLOGUE=prologue, ADD_RESIDUAL=out_residual is not None, BLOCK_N=config.block_n, KS=config.block_k,
        SPLIT_K=split, EVEN_K=k % config.block_k == 0, EVEN_N=n % config.block_n == 0,
        STATS_BLOCK=min(next_pow2(k), gemv.STATS_ELEMENTS), ONE_PASS=next_pow2(k) <= gemv.STATS_ELEMENTS,
        W_SCALED=weight_scale is not None, **launch_options(config, target)))


# Decode batches of 16-128 rows: the same idea with tensor cores. A program's weight slice is
# CHUNKS tiles of `[BLOCK_N, BK]`, each in its own registers (Triton has no indexing into a register
# tensor, hence one variable per tile), all loaded before the wait; after it, each tile meets its
# `[BLOCK_M, BK]` tile of x (from L2) in `tl.dot`. The K loop of gemv.py at these rows let the
# software pipeline stage weight and x together, after the wait (docs/performance.md, lever 23).
MAX_CHUNKS = 8


@triton.jit
def _w_tile(w_ptr, cols, col_mask, k0, K, stride_wn, BK: tl.constexpr, EVEN_N: tl.constexpr,
            EVEN_K: tl.constexpr):
    """The weight tile `[BLOCK_N, BK]` at K offset k0 (zeros past N and K)."""
    ks = k0 + tl.arange(0, BK)
    ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    if EVEN_N and EVEN_K:
        return tl.load(ptrs)
    elif EVEN_K:
        return tl.load(ptrs, mask=col_mask[:, None], other=0.0)
    else:
        return tl.load(ptrs, mask=col_mask[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit
def _x_tile(x_ptr, rows, row_mask, k0, K, stride_xm, BK: tl.constexpr, PROLOGUE: tl.constexpr,
            EVEN_K: tl.constexpr, DT: tl.constexpr):
    """prologue(x)[rows, k0:k0+BK]: `[BLOCK_M, BK]` in DT."""
    ks = k0 + tl.arange(0, BK)
    if EVEN_K:
        k_mask = tl.full([BK], 1, tl.int1)
    else:
        k_mask = ks < K
    unused = tl.zeros_like(row_mask.to(tl.float32))
    return _input_tile(x_ptr, x_ptr, x_ptr, x_ptr, x_ptr, rows, row_mask, ks, k_mask, K, unused, unused, 0,
                       stride_xm, 0, 0, PROLOGUE, DT)


@triton.jit
def _slice_rows_kernel(out_ptr, x_ptr, w_ptr, out_res_ptr, part_ptr, count_ptr, w_scale_ptr, M, N, K,
                       stride_xm, stride_wn, stride_om, stride_orm,
                       PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BK: tl.constexpr, CHUNKS: tl.constexpr, SPLIT_K: tl.constexpr,
                       EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, W_SCALED: tl.constexpr,
                       PDL: tl.constexpr = False):
    """out `[M, N]` = prologue(x) `[M, K]` @ w `[N, K]`.T (+ out_res) for PROLOGUE NONE or SILU_AND_MUL.
    Grid `(cdiv(N, BLOCK_N), SPLIT_K)`; program (n, s) covers K from s * CHUNKS * BK, CHUNKS tiles of BK."""
    DT = out_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    k0 = pid_k * (CHUNKS * BK)
    w0 = _w_tile(w_ptr, cols, col_mask, k0, K, stride_wn, BK, EVEN_N, EVEN_K)
    if CHUNKS > 1:
        w1 = _w_tile(w_ptr, cols, col_mask, k0 + BK, K, stride_wn, BK, EVEN_N, EVEN_K)
    if CHUNKS > 2:
        w2 = _w_tile(w_ptr, cols, col_mask, k0 + 2 * BK, K, stride_wn, BK, EVEN_N, EVEN_K)
    if CHUNKS > 3:
        w3 = _w_tile(w_ptr, cols, col_mask, k0 + 3 * BK, K, stride_wn, BK, EVEN_N, EVEN_K)
    if CHUNKS > 4:
        w4 = _w_tile(w_ptr, cols, col_mask, k0 + 4 * BK, K, stride_wn, BK, EVEN_N, EVEN_K)
    if CHUNKS > 5:
        w5 = _w_tile(w_ptr, cols, col_mask, k0 + 5 * BK, K, stride_wn, BK, EVEN_N, EVEN_K)
    if CHUNKS > 6:
        w6 = _w_tile(w_ptr, cols, col_mask, k0 + 6 * BK, K, stride_wn, BK, EVEN_N, EVEN_K)
    if CHUNKS > 7:
        w7 = _w_tile(w_ptr, cols, col_mask, k0 + 7 * BK, K, stride_wn, BK, EVEN_N, EVEN_K)
    pdl_wait(PDL)             # the whole slice is in flight; x and the outputs belong to the kernels around
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    a0 = _x_tile(x_ptr, rows, row_mask, k0, K, stride_xm, BK, PROLOGUE, EVEN_K, DT)   # every x tile in flight at once
    if CHUNKS > 1:
        a1 = _x_tile(x_ptr, rows, row_mask, k0 + BK, K, stride_xm, BK, PROLOGUE, EVEN_K, DT)
    if CHUNKS > 2:
        a2 = _x_tile(x_ptr, rows, row_mask, k0 + 2 * BK, K, stride_xm, BK, PROLOGUE, EVEN_K, DT)
    if CHUNKS > 3:
        a3 = _x_tile(x_ptr, rows, row_mask, k0 + 3 * BK, K, stride_xm, BK, PROLOGUE, EVEN_K, DT)
    if CHUNKS > 4:
        a4 = _x_tile(x_ptr, rows, row_mask, k0 + 4 * BK, K, stride_xm, BK, PROLOGUE, EVEN_K, DT)
    if CHUNKS > 5:
        a5 = _x_tile(x_ptr, rows, row_mask, k0 + 5 * BK, K, stride_xm, BK, PROLOGUE, EVEN_K, DT)
    if CHUNKS > 6:
        a6 = _x_tile(x_ptr, rows, row_mask, k0 + 6 * BK, K, stride_xm, BK, PROLOGUE, EVEN_K, DT)
    if CHUNKS > 7:
        a7 = _x_tile(x_ptr, rows, row_mask, k0 + 7 * BK, K, stride_xm, BK, PROLOGUE, EVEN_K, DT)
    acc = tl.dot(a0, tl.trans(w0.to(DT)), tl.zeros([BLOCK_M, BLOCK_N], tl.float32))     # FP8 widens exactly
    if CHUNKS > 1:
        acc = tl.dot(a1, tl.trans(w1.to(DT)), acc)
    if CHUNKS > 2:
        acc = tl.dot(a2, tl.trans(w2.to(DT)), acc)
    if CHUNKS > 3:
        acc = tl.dot(a3, tl.trans(w3.to(DT)), acc)
    if CHUNKS > 4:
        acc = tl.dot(a4, tl.trans(w4.to(DT)), acc)
    if CHUNKS > 5:
        acc = tl.dot(a5, tl.trans(w5.to(DT)), acc)
    if CHUNKS > 6:
        acc = tl.dot(a6, tl.trans(w6.to(DT)), acc)
    if CHUNKS > 7:
        acc = tl.dot(a7, tl.trans(w7.to(DT)), acc)
    _finish(acc, out_ptr, out_res_ptr, part_ptr, count_ptr, w_scale_ptr, rows, cols, row_mask, col_mask, M, N,
            pid_n, pid_k, stride_om, stride_orm, ADD_RESIDUAL, SPLIT_K, W_SCALED, BLOCK_M, BLOCK_N, DT)


def rows_splits(k: int, config: KernelConfig) -> int:
    """Programs per column block of the rows kernel: K in spans of `block_k * split_k` (split_k = tiles
    per program, CHUNKS)."""
    return -(-k // (config.block_k * config.split_k))


def slice_rows_launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: KernelConfig,
                      target: str, *, prologue: int = NONE, out_residual: torch.Tensor | None = None,
                      workspace: torch.Tensor | None = None, counters: torch.Tensor | None = None,
                      weight_scale: torch.Tensor | None = None) -> Launch:
    """The launch of `out [M, N] = prologue(x) @ weight.T (+ out_residual)` for M <= 128 rows (padded to
    `max(16, next_pow2(M))`); x `[M, K]` (`[M, 2K]` for SILU_AND_MUL), weight `[N, K]`, unit stride
    along K. `config`: block_n columns, block_k = BK (a power of two), split_k = tiles per program
    (CHUNKS, <= MAX_CHUNKS). More than one span of K needs `workspace` (>= splits * M * N float32)
    and `counters` (int32 zeros, >= cdiv(N, block_n))."""
    rows, n = out.shape
    k = weight.shape[1]
    if prologue not in (NONE, SILU_AND_MUL):
        raise ValueError("the rows slice kernel takes no norm prologue (each program would read whole rows)")
    if not 1 <= config.split_k <= MAX_CHUNKS or config.block_k != next_pow2(config.block_k):
        raise ValueError(f"gemv_slice rows: block_k a power of two, 1..{MAX_CHUNKS} tiles, got {config}")
    if rows > gemv.MAX_DOT_ROWS:
        raise ValueError(f"the rows slice kernel takes at most {gemv.MAX_DOT_ROWS} rows, got {rows}")
    split = rows_splits(k, config)
    if split > 1 and (workspace is None or counters is None):
        raise ValueError("a split-K slice kernel needs a workspace and counters")
    out_res = out_residual if out_residual is not None else out
    return Launch(_slice_rows_kernel, (-(-n // config.block_n), split), (
        out, x, weight, out_res, workspace if workspace is not None else out,
        counters if counters is not None else out, weight_scale if weight_scale is not None else out,
        rows, n, k, x.stride(0), weight.stride(0), out.stride(0), out_res.stride(0)), dict(
        PROLOGUE=prologue, ADD_RESIDUAL=out_residual is not None,
        BLOCK_M=max(gemv.DOT_ROWS, next_pow2(rows)), BLOCK_N=config.block_n, BK=config.block_k,
        CHUNKS=config.split_k, SPLIT_K=split, EVEN_N=n % config.block_n == 0,
        EVEN_K=k % (config.block_k * config.split_k) == 0, W_SCALED=weight_scale is not None,
        **launch_options(config, target)))
