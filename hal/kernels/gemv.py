"""Skinny GEMMs for decode: `y = prologue(x) @ W.T (+ residual)` for M = 1..8 rows, streaming the
weight `W: [N, K]` once, with the small ops around a projection folded in.

Why: at batch 1-8 a decode step is a stream of weight reads (10.1 GB per Ouro-1.4B step), cut into
about 12 launches per layer and loop. A projection that normalises its own input (RMSNorm in the
prologue), applies SwiGLU on the way in, or adds the residual on the way out saves the launch and
the round trip of the op it absorbs.

Prologues (`PROLOGUE`: plain x, RMSNorm, SwiGLU, Ouro's and Huginn's sandwich boundaries) and the
row statistics they need: hal/kernels/gemv_prologue.py. Epilogue: `ADD_RESIDUAL` returns
`residual + y` (each rounded as torch rounds `h + proj(x)`).

Tiling. A program owns `BLOCK_N` output columns and a `1 / SPLIT_K` share of K. With `BLOCK_M == 1`
(M = 1) it multiplies in fp32 FMAs over a `[BLOCK_N, BLOCK_K]` tile (16-byte loads along K, one
reduction at the end); with `BLOCK_M >= 16` (M = 2..16 pad to 16, more rows to the next power of two
up to MAX_DOT_ROWS; rows past M masked) it takes `tl.dot` (the loads then go through the software
pipeline, `num_stages` deep). Row statistics of the norm
prologues are computed per program over the whole row (x is M x K elements, in L2: small beside the
program's BLOCK_N x K weight bytes). Split-K is deterministic: every split writes its fp32 partial,
and the last split to arrive at a column block (an atomic counter, reset by that program) sums the
partials in split order and runs the epilogue. So the result depends on the config and the shape,
never on timing: graphs on and off, and any run, give the same bits.

FP8 weights (W8A16, `fp8_linear`): the weight streams as FP8 (half the bytes, which is what decode
at these row counts is bound by), widens exactly in registers, and its per-channel scales multiply the
fp32 sum once, as hal/kernels/fp8_linear.py does for larger M.

Grid `(cdiv(N, BLOCK_N), SPLIT_K)`. The Hal ops that route projections here, or to the unfused torch
path, are hal/kernels/gemv_ops.py.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hal.kernels.configs import KernelConfig
from hal.kernels.gemv_prologue import (  # noqa: F401 (re-exported)
    ADD_NORM,
    NONE,
    NORM_ADD,
    RMS_NORM,
    SILU_AND_MUL,
    _input_tile,
    _row_stats,
)
from hal.kernels.launch import Launch, launch_options, next_pow2
from hal.kernels.pdl import pdl_wait

DOT_ROWS = 16                    # tl.dot needs 16 rows: M = 2..8 pads to this
MAX_DOT_ROWS = 128               # rows one program holds; gemv_ops routes more than MAX_ROWS here only
                                 # with a gemv_wide entry, which no table has (at 64 and 128 rows cuBLAS
                                 # was faster on every projection: docs/performance.md, levers 23 and 53)
MAX_SPLIT_K = 16
MIN_TILES_PER_SPLIT = 2          # a split streams at least this many BLOCK_K tiles
STATS_ELEMENTS = 8192            # elements of x per step of the row-statistics pass
# decode batches past gemv_ops.MAX_ROWS (the `gemv_wide` entry): the split-K plan fills one wave of
# programs, counting how many fit a compute unit by shared memory (an H100/H200 SM has 227 KiB);
# a program of 64 rows x 128 columns streams 16 KiB of weights per 64-element K tile, and more than
# MAX_WIDE_SPLIT partials would make the last split's sum (64 x BLOCK_N fp32 each) the tail
SMEM_PER_UNIT = 227 * 1024
MAX_WIDE_SPLIT = 8


@triton.jit
def _weight_rows(w_cols, cols, col_limit, ks, k_hi, EVEN_K: tl.constexpr):
    """The FMA path's weight tile `[BLOCK_N, BLOCK_K]` at K offsets ks; columns >= col_limit read as
    zeros (col_limit 0: a prefetch past the end, which loads nothing)."""
    if EVEN_K:                # full tiles: the mask is constant along K, so loads stay 16-byte vectors
        mask = (cols < col_limit)[:, None]
    else:
        mask = (cols < col_limit)[:, None] & (ks < k_hi)[None, :]
    return tl.load(w_cols[:, None] + ks[None, :], mask=mask, other=0.0)


@triton.jit
def _store_out(out_ptr, out_res_ptr, acc, rows, cols, mask, stride_om, stride_orm,
               ADD_RESIDUAL: tl.constexpr, DT: tl.constexpr):
    y = acc.to(DT)
    if ADD_RESIDUAL:          # torch: residual + proj(x), both in DT
        res = tl.load(out_res_ptr + rows[:, None] * stride_orm + cols[None, :], mask=mask, other=0.0)
        y = (res.to(tl.float32) + y.to(tl.float32)).to(DT)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y, mask=mask)


@triton.jit
def _gemv_kernel(out_ptr, x_ptr, w_ptr, res_ptr, stream_ptr, in_norm_ptr, res_norm_ptr, out_res_ptr,
                 part_ptr, count_ptr, w_scale_ptr, M, N, K, eps, k_per_split,
                 stride_xm, stride_rm, stride_sm, stride_wn, stride_om, stride_orm,
                 PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STATS_BLOCK: tl.constexpr,
                 ONE_PASS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
                 W_SCALED: tl.constexpr, PRELOAD: tl.constexpr = False, PDL: tl.constexpr = False):
    """out `[M, N]` = prologue(x) `[M, K]` @ w `[N, K]`.T (+ out_res); see the module docstring.
    Grid `(cdiv(N, BLOCK_N), SPLIT_K)`; the split-K partials go to part `[SPLIT_K, M, N]` fp32.
    W_SCALED: w is FP8 with one float32 scale per output column (`w_scale`), applied to the sum.
    PRELOAD (tl.dot path): the split's first weight tile is loaded before the PDL wait."""
    DT = out_ptr.dtype.element_ty                    # bf16 or fp16: x, weights and outputs share it
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_cols = w_ptr + cols.to(tl.int64) * stride_wn                                 # [BLOCK_N] row starts
    if BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        if PREFETCH:          # the first weight tile is in flight while the row statistics are computed
            w_next = _weight_rows(w_cols, cols, tl.where(k_lo < k_hi, N, 0), k_lo + tl.arange(0, BLOCK_K),
                                  k_hi, EVEN_K)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if PRELOAD:           # weights never depend on the kernel before: the first tile streams under its tail
            ks0 = k_lo + tl.arange(0, BLOCK_K)
            w_first = tl.load(w_cols[None, :] + ks0[:, None], mask=(ks0 < k_hi)[:, None] & col_mask[None, :],
                              other=0.0)
    w_scale = _weight_scale(w_scale_ptr, cols, col_mask, W_SCALED, BLOCK_N)
    pdl_wait(PDL)             # the first weight tile is in flight; x comes from the kernel before
    inv_src = tl.zeros([BLOCK_M], tl.float32)
    inv_stream = inv_src
    if PROLOGUE == 1 or PROLOGUE >= 3:
        inv_src, inv_stream = _row_stats(x_ptr, res_ptr, res_norm_ptr, rows, row_mask, K, eps, stride_xm,
                                         stride_rm, PROLOGUE, BLOCK_M, STATS_BLOCK, ONE_PASS, DT)
    stream_rows = tl.where(pid_n == 0, M, 0)          # the first column block writes h
    k_start = k_lo
    if BLOCK_M > 1 and PRELOAD:
        ks0 = k_lo + tl.arange(0, BLOCK_K)
        a = _input_tile(x_ptr, res_ptr, in_norm_ptr, res_norm_ptr, stream_ptr, rows, row_mask, ks0, ks0 < k_hi, K,
                        inv_src, inv_stream, stream_rows, stride_xm, stride_rm, stride_sm, PROLOGUE, DT)
        acc = tl.dot(a, w_first.to(DT), acc)
        k_start = k_lo + BLOCK_K
    for k0 in range(k_start, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:            # K is a multiple of BLOCK_K: no mask along the loads' vector axis
            k_mask = tl.full([BLOCK_K], 1, tl.int1)
        else:
            k_mask = ks < k_hi
        if BLOCK_M == 1:
            if PREFETCH:      # registers double-buffer the weight: tile k0 + BLOCK_K is in flight while
                w = w_next    # tile k0 is multiplied (the pipeliner only stages loads that feed tl.dot)
                w_next = _weight_rows(w_cols, cols, tl.where(k0 + BLOCK_K < k_hi, N, 0), ks + BLOCK_K, k_hi,
                                      EVEN_K)
            else:
                w = _weight_rows(w_cols, cols, N, ks, k_hi, EVEN_K)
        a = _input_tile(x_ptr, res_ptr, in_norm_ptr, res_norm_ptr, stream_ptr, rows, row_mask, ks, k_mask, K,
                        inv_src, inv_stream, stream_rows, stride_xm, stride_rm, stride_sm, PROLOGUE, DT)
        if BLOCK_M == 1:
            acc2 += w.to(tl.float32) * a.to(tl.float32)                            # [BLOCK_N, BLOCK_K]
        else:
            w = tl.load(w_cols[None, :] + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(a, w.to(DT), acc)                                         # FP8 widens exactly
    if BLOCK_M == 1:
        acc = tl.sum(acc2, 1)[None, :]
    _finish(acc, out_ptr, out_res_ptr, part_ptr, count_ptr, w_scale, rows, cols, row_mask, col_mask, M, N,
            pid_n, pid_k, stride_om, stride_orm, ADD_RESIDUAL, SPLIT_K, W_SCALED, BLOCK_M, BLOCK_N, DT)


@triton.jit
def _weight_scale(w_scale_ptr, cols, col_mask, W_SCALED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The FP8 weight's scale of every column `[BLOCK_N]` (1 unscaled): a weight, so kernels read it
    before their PDL wait."""
    if W_SCALED:
        return tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
    return tl.full([BLOCK_N], 1.0, tl.float32)


@triton.jit
def split_k_arrive(acc, part_ptr, count_ptr, tile, pid_k, rows, cols, mask, M, N, SPLIT_K: tl.constexpr):
    """Split-K's deterministic sum, first half: this program's fp32 partial `acc` goes to part
    `[SPLIT_K, M, N]` and it arrives at output tile `tile`'s atomic counter. Returns (split 0's partials,
    whether this is the last split to arrive), which then sums them in split order (`split_k_total`) and
    resets the counter."""
    parts = part_ptr + (rows[:, None] * N + cols[None, :])                         # split 0's [M, N]
    tl.store(parts + pid_k * M * N, acc, mask=mask)
    tl.debug_barrier()                    # every thread's partial is written before the release
    arrived = tl.atomic_add(count_ptr + tile, 1)                                   # acq_rel, device scope
    return parts, arrived == SPLIT_K - 1


@triton.jit
def split_k_total(parts, mask, M, N, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The partials of every split, summed in split order (the same bits run after run)."""
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(parts + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _finish(acc, out_ptr, out_res_ptr, part_ptr, count_ptr, w_scale, rows, cols, row_mask, col_mask, M, N,
            pid_n, pid_k, stride_om, stride_orm, ADD_RESIDUAL: tl.constexpr, SPLIT_K: tl.constexpr,
            W_SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr):
    """The epilogue of a program's fp32 sum `acc [BLOCK_M, BLOCK_N]`: the FP8 weight scale (`w_scale`), the
    residual add, the store; with split-K the partial goes to part `[SPLIT_K, M, N]` and the last
    split to arrive at the column block sums them in split order (deterministic) and stores."""
    mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        if W_SCALED:
            acc = acc * w_scale[None, :]
        _store_out(out_ptr, out_res_ptr, acc, rows, cols, mask, stride_om, stride_orm, ADD_RESIDUAL, DT)
    else:
        parts, last = split_k_arrive(acc, part_ptr, count_ptr, pid_n, pid_k, rows, cols, mask, M, N, SPLIT_K)
        if last:                             # the last split of this column block
            total = split_k_total(parts, mask, M, N, SPLIT_K, BLOCK_M, BLOCK_N)
            if W_SCALED:
                total = total * w_scale[None, :]
            _store_out(out_ptr, out_res_ptr, total, rows, cols, mask, stride_om, stride_orm, ADD_RESIDUAL, DT)
            tl.atomic_xchg(count_ptr + pid_n, 0)                                   # ready for the next launch


class Plan(NamedTuple):
    """Host-side choices of one launch (they depend on the shape and the config only)."""

    block_m: int
    split_k: int
    k_per_split: int             # a multiple of block_k


def config_key(num_rows: int) -> str:
    """Table key: "gemv_m1" for one row (the FMA path), "gemv" for more rows (tl.dot)."""
    return "gemv_m1" if num_rows == 1 else "gemv"


def plan(num_rows: int, n: int, k: int, config: KernelConfig, num_compute_units: int, wide: bool = False) -> Plan:
    """Split-K and row block for an `[num_rows, k] x [n, k]` product. `config.split_k == 0` picks
    the smallest power of two that gives every compute unit a program, keeping at least
    MIN_TILES_PER_SPLIT tiles of K per split; with `wide` (decode batches, the first weight tile
    preloaded) the most splits, up to MAX_WIDE_SPLIT, whose programs all run at once."""
    if num_rows > MAX_DOT_ROWS:
        raise ValueError(f"the gemv kernels take at most {MAX_DOT_ROWS} rows, got {num_rows}")
    block_m = 1 if config.block_m == 1 and num_rows == 1 else max(DOT_ROWS, next_pow2(num_rows))
    k_tiles = -(-k // config.block_k)
    split = config.split_k
    if split == 0 and wide:
        split = _wide_split(-(-n // config.block_n), k_tiles, block_m, config, num_compute_units)
    elif split == 0:
        split = auto_split_k(-(-n // config.block_n), k_tiles, num_compute_units)
    split, tiles_per_split = whole_splits(k_tiles, split)
    return Plan(block_m, split, tiles_per_split * config.block_k)


def auto_split_k(num_tiles: int, k_tiles: int, num_compute_units: int,
                 min_tiles_per_split: int = MIN_TILES_PER_SPLIT) -> int:
    """The smallest power of two of splits that gives every compute unit one of `num_tiles` output tiles'
    programs, keeping at least `min_tiles_per_split` of the `k_tiles` steps of K per split."""
    split = 1
    while (num_tiles * split < num_compute_units and split < MAX_SPLIT_K
           and k_tiles // (2 * split) >= min_tiles_per_split):
        split *= 2
    return split


def whole_splits(k_tiles: int, split: int) -> tuple[int, int]:
    """(splits, K steps per split) for about `split` splits of `k_tiles` steps, each split whole steps
    (the last may hold fewer)."""
    tiles_per_split = -(-k_tiles // max(1, min(split, k_tiles)))
    return -(-k_tiles // tiles_per_split), tiles_per_split


def _wide_split(col_blocks: int, k_tiles: int, block_m: int, config: KernelConfig, num_compute_units: int) -> int:
    """The most splits (<= MAX_WIDE_SPLIT) whose `col_blocks x splits` programs fit the device at once,
    programs per unit estimated from the pipeline's shared memory: a 16-bit x and weight tile per
    stage, and one more for the preloaded tile's product (what Triton 3.6 allocates for sm_90)."""
    tile_bytes = 2 * config.block_k * (block_m + config.block_n)
    smem = (config.num_stages + 1) * tile_bytes
    slots = num_compute_units * max(1, SMEM_PER_UNIT // smem)
    split = 1
    for s in range(1, min(MAX_WIDE_SPLIT, k_tiles) + 1):
        whole = -(-k_tiles // -(-k_tiles // s))              # splits of whole tiles
        if col_blocks * whole <= slots:
            split = max(split, whole)
    return split


def gemv_launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: KernelConfig, target: str,
                num_compute_units: int, *, prologue: int = NONE, eps: float = 0.0,
                norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                res_norm_weight: torch.Tensor | None = None, stream_out: torch.Tensor | None = None,
                out_residual: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                counters: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
                preload: bool = False) -> Launch:
    """The launch of `out [M, N] = prologue(x) @ weight.T (+ out_residual)`; x `[M, K]` (`[M, 2K]`
    for SILU_AND_MUL), weight `[N, K]`, all rows with unit stride along K. Split-K launches need
    `workspace` (>= split * M * N float32) and `counters` (int32 zeros, >= cdiv(N, block_n)).
    An FP8 `weight` takes `weight_scale: [N]` float32 (one scale per output channel, zoo/fp8.py)."""
    rows, n = out.shape
    k = weight.shape[1]
    p = plan(rows, n, k, config, num_compute_units, wide=preload)
    if p.split_k > 1 and (workspace is None or counters is None):
        raise ValueError("a split-K gemv needs a workspace and counters")
    unused = x                                         # pointers a prologue never reads (constexpr-dead)
    res = residual if residual is not None else unused
    stream = stream_out if stream_out is not None else out
    out_res = out_residual if out_residual is not None else out
    return Launch(_gemv_kernel, (-(-n // config.block_n), p.split_k), (
        out, x, weight, res, stream,
        norm_weight if norm_weight is not None else weight, res_norm_weight if res_norm_weight is not None else weight,
        out_res, workspace if workspace is not None else out, counters if counters is not None else out,
        weight_scale if weight_scale is not None else out, rows, n, k, eps, p.k_per_split,
        x.stride(0), res.stride(0), stream.stride(0), weight.stride(0), out.stride(0), out_res.stride(0)), dict(
        PROLOGUE=prologue, ADD_RESIDUAL=out_residual is not None, BLOCK_M=p.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, STATS_BLOCK=min(next_pow2(k), STATS_ELEMENTS // p.block_m),
        ONE_PASS=next_pow2(k) <= STATS_ELEMENTS // p.block_m, SPLIT_K=p.split_k,
        EVEN_K=k % config.block_k == 0, PREFETCH=p.block_m == 1 and config.num_stages > 1,
        W_SCALED=weight_scale is not None, PRELOAD=preload and p.block_m > 1,
        **launch_options(config, target)))
