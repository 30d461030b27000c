"""FP8-weight linear for GPUs without (or not using) `torch._scaled_mm`: `y = x @ (q * scale).T`
with the weight `q: [N, K]` in FP8 and one float32 scale per output channel, activations in
bf16/fp16/fp32 (W8A16). The `_scaled_mm` path's activation quantization is hal/kernels/fp8_rows.py.

A program owns a `BLOCK_M x BLOCK_N` tile of y and walks K in steps of `BLOCK_K` (the config's `block_k`,
64 where it has none): the FP8 weight tile is loaded (half the bytes of bf16, which is what decode at
small M is bound by), widened to x's dtype
(exact) and multiplied on the tensor cores with float32 accumulation; the row scales multiply the
accumulator once at the end (they factor out of the sum over K), then the bias. Every product is
exact and only the accumulation order differs from the torch reference (dequantize in float32, then
matmul), so the two agree to float32 rounding for fp32 activations.

Split-K (the config's `split_k`: 1 none, n that many, 0 as many as give every compute unit a program while
each split keeps MIN_K_PER_SPLIT of K): a hundred rows leave Ouro-1.4B's 2,048-wide products a few dozen
tiles, fewer programs than SMs, each streaming all of K; split, each program streams a share of K and the
last split of a tile sums the fp32 partials in split order (`gemv.split_k_total`: the same bits run after
run) before the epilogue. Grid `(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), splits)`.

PDL (hal/kernels/pdl.py): the kernel waits for the one before only when it needs x. The W8A8 form (rows
quantized by the kernel before: a prompt's products of up to 128 rows) loads its first weight tile before
that wait (PRELOAD), so the tile streams while the boundary or the quantization before it drains.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hal.common.quantized_rows import QuantizedRows
from hal.kernels.attention import dot_precision
from hal.kernels.configs import KernelConfig
from hal.kernels.gemv import auto_split_k, split_k_arrive, split_k_total, whole_splits
from hal.kernels.launch import Launch, backend_of, check_device, launch_options, run_launch
from hal.kernels.pdl import pdl_wait

BLOCK_K = 64
# a split-K share shorter than this lost on an H100 at 128 rows (lever 139's probe): o (K = 2,048) 7.3 us
# whole, 7.6 in two, 9.1 in four; down (K = 5,632) 15.6 whole, 12.1 in two or four; q|k|v in two 9.4 -> 12.7
MIN_K_PER_SPLIT = 1536
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
# W8A8 products whose output tiles number at most this many per compute unit take the table's deep entry
# (`fp8_linear_w8a8_deep`, lever 140): its longer K step holds two programs an SM on sm_90, so a grid past
# that runs a second round of programs (the H100 probe, 58th session: 64 x 64 tiles, 256 of K in 3 stages won
# every Ouro-1.4B product of 64 and 128 rows by 0.4-1.8 us but gate|up at 128 rows, 352 tiles on 132 SMs)
DEEP_MAX_TILES_PER_UNIT = 2


@triton.jit(do_not_specialize=["num_rows"])      # a step's size (hal/kernels/launch.py)
def _fp8_linear_kernel(out_ptr, x_ptr, w_ptr, scale_ptr, bias_ptr, x_scale_ptr, part_ptr, count_ptr, num_rows,
                       num_cols, num_inner, k_per_split, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_X_SCALE: tl.constexpr = False,
                       SPLIT_K: tl.constexpr = 1, PRELOAD: tl.constexpr = False, PDL: tl.constexpr = False):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < num_cols
    first = tl.program_id(2) * k_per_split                                      # this split's share of K
    end = tl.minimum(first + k_per_split, num_inner)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm                                # [M, 1]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn                                # [1, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = first
    if PRELOAD:               # weights depend on no kernel: the first tile streams under the last one's tail
        inner = first + tl.arange(0, BLOCK_K)
        inner_ok = inner < end
        b = tl.load(w_ptrs + inner[:, None], mask=inner_ok[:, None] & col_ok[None, :], other=0.0)
    pdl_wait(PDL)             # x and its scales come from the kernel before
    if PRELOAD:
        a = tl.load(x_ptrs + inner[None, :], mask=row_ok[:, None] & inner_ok[None, :], other=0.0)
        acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION)
        k_start = first + BLOCK_K
    for step in range(tl.cdiv(end - k_start, BLOCK_K)):
        inner = k_start + step * BLOCK_K + tl.arange(0, BLOCK_K)
        inner_ok = inner < end
        a = tl.load(x_ptrs + inner[None, :], mask=row_ok[:, None] & inner_ok[None, :], other=0.0)   # [M, K]
        b = tl.load(w_ptrs + inner[:, None], mask=inner_ok[:, None] & col_ok[None, :], other=0.0)   # [K, N]
        acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        _epilogue(acc, out_ptr, scale_ptr, bias_ptr, x_scale_ptr, rows, cols, row_ok, col_ok, mask, stride_om,
                  HAS_BIAS, HAS_X_SCALE)
    else:
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        parts, last = split_k_arrive(acc, part_ptr, count_ptr, tile, tl.program_id(2), rows, cols, mask,
                                     num_rows, num_cols, SPLIT_K)
        if last:                             # the last split of this tile
            total = split_k_total(parts, mask, num_rows, num_cols, SPLIT_K, BLOCK_M, BLOCK_N)
            _epilogue(total, out_ptr, scale_ptr, bias_ptr, x_scale_ptr, rows, cols, row_ok, col_ok, mask,
                      stride_om, HAS_BIAS, HAS_X_SCALE)
            tl.atomic_xchg(count_ptr + tile, 0)                                    # ready for the next launch


@triton.jit
def _epilogue(acc, out_ptr, scale_ptr, bias_ptr, x_scale_ptr, rows, cols, row_ok, col_ok, mask, stride_om,
              HAS_BIAS: tl.constexpr, HAS_X_SCALE: tl.constexpr):
    acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_X_SCALE:         # W8A8: x's rows came quantized (FP8 x FP8 products on the tensor cores)
        acc = acc * tl.load(x_scale_ptr + rows, mask=row_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


def tile_grid(num_rows: int, num_cols: int, config: KernelConfig) -> tuple[int, int]:
    """Output tiles along M and N (a tile has at least 16 rows: the least M tl.dot takes)."""
    return -(-num_rows // max(config.block_m, 16)), -(-num_cols // config.block_n)


class SplitPlan(NamedTuple):
    """The grid's K side of one launch (it depends on the shape, the config and the device's size only)."""

    split_k: int
    k_per_split: int                     # a multiple of the config's K step


def split_plan(num_rows: int, num_cols: int, num_inner: int, config: KernelConfig,
               num_compute_units: int) -> SplitPlan:
    """How many programs share each output tile's K (module docstring): none past COUNTER_SLOTS tiles."""
    from hal.kernels.gemv_ops import COUNTER_SLOTS

    block_k = config.block_k or BLOCK_K
    k_tiles = max(1, -(-num_inner // block_k))
    num_tiles = math.prod(tile_grid(num_rows, num_cols, config))
    min_tiles = -(-MIN_K_PER_SPLIT // block_k)
    split = config.split_k or auto_split_k(num_tiles, k_tiles, num_compute_units, min_tiles)
    if num_tiles > COUNTER_SLOTS:
        split = 1
    split, tiles_per_split = whole_splits(k_tiles, split)
    return SplitPlan(split, tiles_per_split * block_k)


def w8a8_config(num_rows: int, num_cols: int, entry: KernelConfig, deep: KernelConfig | None,
                num_compute_units: int) -> KernelConfig:
    """The W8A8 tile's config for an `[num_rows, K] x [num_cols, K]` product: `deep` where its tiles fit
    DEEP_MAX_TILES_PER_UNIT to a compute unit, else the table's `entry`."""
    if deep is None:
        return entry
    num_tiles = math.prod(tile_grid(num_rows, num_cols, deep))
    return deep if num_tiles <= DEEP_MAX_TILES_PER_UNIT * num_compute_units else entry


def fp8_linear_launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                      out: torch.Tensor, config: KernelConfig, target: str,
                      x_scale: torch.Tensor | None = None, plan: SplitPlan | None = None,
                      workspace: torch.Tensor | None = None, counters: torch.Tensor | None = None) -> Launch:
    """x `[M, K]` (FP8 with `x_scale` `[M, 1]` float32: W8A8), weight `[N, K]` FP8, scale `[N]` float32,
    bias `[N]` or None, out `[M, N]`; `plan` from `split_plan` (None: the config's on one compute unit). A
    split-K plan needs `workspace` (>= splits * M * N float32) and `counters` (int32 zeros, one per output
    tile: hal/kernels/gemv_ops.split_counters)."""
    rows, inner = x.shape
    cols = weight.shape[0]
    p = plan or split_plan(rows, cols, inner, config, 1)
    if p.split_k > 1 and (workspace is None or counters is None):
        raise ValueError("a split-K fp8_linear needs a workspace and counters")
    grid = (*tile_grid(rows, cols, config), p.split_k)
    return Launch(_fp8_linear_kernel, grid, (
        out, x, weight, scale, scale if bias is None else bias, scale if x_scale is None else x_scale,
        out if workspace is None else workspace, out if counters is None else counters, rows, cols, inner,
        p.k_per_split, x.stride(0), weight.stride(0), out.stride(0)), dict(
        HAS_BIAS=bias is not None, BLOCK_M=max(config.block_m, 16), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k or BLOCK_K, DOT_PRECISION=dot_precision(x.dtype, target),
        HAS_X_SCALE=x_scale is not None, SPLIT_K=p.split_k, PRELOAD=x_scale is not None,
        **launch_options(config, target)))


def fp8_linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None, config: KernelConfig | None = None) -> torch.Tensor:
    """`x: [M, K]` times FP8 `weight: [N, K]` with row scales `scale: [N]` (+ `bias`) -> `[M, N]` in
    x's dtype (`Hal.op("fp8_linear")`). x as `QuantizedRows` (FP8 rows of the weight's format and their
    scales) runs W8A8, out in their dtype (a probe: tools/fp8_kernels_bench.py --only prompt)."""
    x_scale, out_dtype = None, x.dtype
    if isinstance(x, QuantizedRows):
        x, x_scale = x.data, x.scale.reshape(-1).float()
        if x.dtype != weight.dtype or x_scale.numel() != x.shape[0]:
            raise ValueError(f"W8A8 fp8_linear takes rows in the weight's format ({weight.dtype}), one scale a "
                             f"row; got {x.dtype}, {x_scale.numel()} scales for {x.shape[0]} rows")
    check_device(x)
    if weight.dtype not in FP8_DTYPES or scale.dtype != torch.float32 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear takes x [M, K], an FP8 weight [N, K] and float32 scales [N]; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, scale {scale.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype, device=x.device)
    if x.shape[0]:
        config = config or KernelConfig(16, 32, 4, 1)
        w = weight if weight.stride(-1) == 1 else weight.contiguous()      # column views (Huginn's adapter) as they are
        plan, kw = None, {}
        if config.split_k != 1:
            from hal.kernels.backend import device_compute_units
            from hal.kernels.gemv_ops import split_counters

            plan = split_plan(x.shape[0], w.shape[0], x.shape[1], config, device_compute_units(x.device))
            if plan.split_k > 1:
                kw["workspace"] = torch.empty(plan.split_k * out.numel(), dtype=torch.float32,
                                              device=x.device)
                kw["counters"] = split_counters(x.device)
        target = backend_of(x.device)
        run_launch(fp8_linear_launch(x, w, scale, bias, out, config, target, x_scale, plan, **kw))
    return out
