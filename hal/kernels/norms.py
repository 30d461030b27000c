"""The norm kernels of the fused small ops (hal/kernels/ops.py maps them to `Hal.op` names):
Llama RMSNorm (+ a post-norm residual add) and `norm_add_norm`, a sublayer boundary's residual add
with the norms around it (sandwich layers: Ouro, Huginn; pre-norm layers: Nanbeige). Each rounds
where zoo/layers.py's torch code rounds (float32 statistics, cast to the input dtype, then the
weight), one row per program.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from hal.kernels.configs import KernelConfig, config_or_default
from hal.kernels.launch import (EXACT_ROUNDING, Launch, backend_of, check_device, launch_options, next_pow2,
                               run_launch)
from hal.kernels.pdl import pdl_wait

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _normed(x, num_cols, eps, X_DTYPE: tl.constexpr):
    """`x * rsqrt(mean(x^2) + eps)` of a row in float32 (masked columns 0), cast to x's dtype and
    back: zoo's RMSNorm rounds there, before the weight."""
    inv_rms = tl.math.rsqrt(tl.sum(x * x, 0) / num_cols + eps)
    return (x * inv_rms).to(X_DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, weight_ptr, residual_ptr, eps, num_cols, stride_x, stride_r, stride_o,
                     BLOCK: tl.constexpr, X_DTYPE: tl.constexpr, NORM_DTYPE: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)     # before the wait: a weight
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    normed = _normed(x, num_cols, eps, X_DTYPE)
    y = (weight * normed).to(NORM_DTYPE)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        y = residual.to(tl.float32) + y.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_add_norm_kernel(y_ptr, stride_y, h_ptr, x_ptr, residual_ptr, post_weight_ptr, weight_ptr, eps,
                          num_cols, stride_x, stride_r, stride_h, BLOCK: tl.constexpr, X_DTYPE: tl.constexpr,
                          MID_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr, NORM_DTYPE: tl.constexpr,
                          HAS_POST: tl.constexpr, SUM_FIRST: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    y = boundary_row(h_ptr, x_ptr, residual_ptr, post_weight_ptr, weight_ptr, row, cols, mask, eps, num_cols,
                     stride_x, stride_r, stride_h, X_DTYPE, MID_DTYPE, H_DTYPE, NORM_DTYPE, HAS_POST,
                     SUM_FIRST, PDL)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def boundary_row(h_ptr, x_ptr, residual_ptr, post_weight_ptr, weight_ptr, row, cols, mask, eps, num_cols,
                 stride_x, stride_r, stride_h, X_DTYPE: tl.constexpr, MID_DTYPE: tl.constexpr,
                 H_DTYPE: tl.constexpr, NORM_DTYPE: tl.constexpr, HAS_POST: tl.constexpr,
                 SUM_FIRST: tl.constexpr, PDL: tl.constexpr):
    """One row of a boundary: stores the residual stream h (one of three boundaries, below) and returns
    `y = norm(h)` in NORM_DTYPE. Each step rounds to the dtype torch's expression rounds to, h included,
    as the launches it replaces store it."""
    # the norm weights before the wait: at one row their reads from HBM, not the rows from L2, are
    # what the kernel would wait on after it
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_POST:
        post_weight = tl.load(post_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_POST:
        if SUM_FIRST:       # Huginn: h = post_norm(x + residual), the sum (MID_DTYPE) normalised
            total = (x + residual).to(MID_DTYPE).to(tl.float32)
            h = (post_weight * _normed(total, num_cols, eps, MID_DTYPE)).to(H_DTYPE)
        else:               # Ouro: h = residual + post_norm(x), post_norm(x) in MID_DTYPE
            post = (post_weight * _normed(x, num_cols, eps, X_DTYPE)).to(MID_DTYPE).to(tl.float32)
            h = (residual + post).to(H_DTYPE)
    else:                   # pre-norm: h = residual + x
        h = (residual + x).to(H_DTYPE)
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)               # masked columns are 0 in h
    normed = _normed(h.to(tl.float32), num_cols, eps, H_DTYPE)
    return (weight * normed).to(NORM_DTYPE)


def rms_norm_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                    out: torch.Tensor, config: KernelConfig, target: str) -> Launch:
    rows, cols = x.shape                                                  # 2-D views
    norm_dtype = torch.promote_types(x.dtype, weight.dtype)
    res = residual if residual is not None else x
    return Launch(_rms_norm_kernel, (rows,), (
        out, x, weight, res, eps, cols, x.stride(0), res.stride(0), out.stride(0)), dict(
        BLOCK=next_pow2(cols), X_DTYPE=_TL_DTYPES[x.dtype], NORM_DTYPE=_TL_DTYPES[norm_dtype],
        HAS_RESIDUAL=residual is not None, **launch_options(config, target)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             configs: dict[str, KernelConfig] | None = None) -> torch.Tensor:
    """Llama RMSNorm of `x: [..., N]` (fp32 math, cast to x.dtype, then * weight); with `residual`
    (same shape) returns `residual + norm(x)`. Output dtype as torch's promotion of the operands."""
    check_device(x)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dtype = torch.promote_types(x.dtype, weight.dtype)
    res2 = None
    if residual is not None:
        dtype = torch.promote_types(dtype, residual.dtype)
        res2 = residual.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    if x2.shape[0]:
        run_launch(rms_norm_launch(x2, weight.contiguous(), eps, res2, out, config_or_default(configs, "rms_norm"),
                                   backend_of(x.device)))
    return out.view(x.shape)


def _stream_dtypes(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                   sum_first: bool) -> tuple[torch.dtype, torch.dtype]:
    """(the intermediate's dtype, h's) as torch promotes them in the boundary's expression: the
    post-norm output (`residual + post_norm(x)`) or the sum (`post_norm(x + residual)`), then h."""
    promote = torch.promote_types
    if post_weight is None:
        return x.dtype, promote(x.dtype, residual.dtype)
    if sum_first:
        total = promote(x.dtype, residual.dtype)
        return total, promote(total, post_weight.dtype)
    post = promote(x.dtype, post_weight.dtype)
    return post, promote(post, residual.dtype)


def norm_add_norm_launch(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                         weight: torch.Tensor, eps: float, y: torch.Tensor, h: torch.Tensor,
                         config: KernelConfig, target: str, sum_first: bool = False) -> Launch:
    return boundary_launch(_norm_add_norm_kernel, (y, y.stride(0)), x, residual, post_weight, weight, eps, h,
                           y.dtype, config, target, sum_first)


def boundary_launch(kernel: Any, outputs: tuple[Any, ...], x: torch.Tensor, residual: torch.Tensor,
                    post_weight: torch.Tensor | None, weight: torch.Tensor, eps: float, h: torch.Tensor,
                    norm_dtype: torch.dtype, config: KernelConfig, target: str, sum_first: bool = False,
                    **constants: Any) -> Launch:
    """A launch of `kernel`, a boundary kernel (`boundary_row` per program) whose own arguments,
    `outputs` (pointers, then strides), come first; 2-D `x`, `residual` and `h`; `constants`: its own.
    Without floating-point contraction, so that the kernels sharing `boundary_row` (`norm_add_norm`,
    `norm_add_norm_quantize`) round every product as written whatever FMAs the compiler would pair in
    each (a precaution: the H100 measured no cost, docs/performance.md lever 132)."""
    rows, cols = x.shape
    mid_dtype, _ = _stream_dtypes(x, residual, post_weight, sum_first)
    post = post_weight if post_weight is not None else weight            # not read without a post-norm
    return Launch(kernel, (rows,), (
        *outputs, h, x, residual, post, weight, eps, cols, x.stride(0), residual.stride(0), h.stride(0)), dict(
        BLOCK=next_pow2(cols), X_DTYPE=_TL_DTYPES[x.dtype], MID_DTYPE=_TL_DTYPES[mid_dtype],
        H_DTYPE=_TL_DTYPES[h.dtype], NORM_DTYPE=_TL_DTYPES[norm_dtype], HAS_POST=post_weight is not None,
        SUM_FIRST=sum_first and post_weight is not None, **constants, **EXACT_ROUNDING,
        **launch_options(config, target)))


class BoundaryRows(NamedTuple):
    """A boundary's operands as the kernels take them: 2-D rows, and h allocated."""

    x: torch.Tensor                     # [M, N]
    residual: torch.Tensor              # [M, N]
    post_weight: torch.Tensor | None
    weight: torch.Tensor
    h: torch.Tensor                     # [M, N], the stream's dtype (empty)
    norm_dtype: torch.dtype             # y's: torch's promotion of h and weight


def boundary_rows(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                  weight: torch.Tensor, sum_first: bool) -> BoundaryRows:
    check_device(x)
    if residual.shape != x.shape:
        raise ValueError(f"norm_add_norm needs x and residual of one shape, got {tuple(x.shape)} "
                         f"and {tuple(residual.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    res2 = residual.reshape(-1, x.shape[-1]).contiguous()
    _, h_dtype = _stream_dtypes(x, residual, post_weight, sum_first)
    post = post_weight.contiguous() if post_weight is not None else None
    return BoundaryRows(x2, res2, post, weight.contiguous(), torch.empty(x2.shape, dtype=h_dtype, device=x.device),
                        torch.promote_types(h_dtype, weight.dtype))


def norm_add_norm(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                  weight: torch.Tensor, eps: float, sum_first: bool = False,
                  configs: dict[str, KernelConfig] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(y, h)`, `x, residual: [..., N]`: a sublayer boundary's residual stream h and the next
    sublayer's input `y = rms_norm(h, weight, eps)` in one launch, h one of
    - `residual + rms_norm(x, post_weight, eps)` (sandwich norms, Ouro),
    - `rms_norm(x + residual, post_weight, eps)` with `sum_first` (Huginn's sandwich block),
    - `residual + x` with `post_weight=None` (pre-norm layers; `sum_first` does not apply).
    Dtypes as torch's promotion in those expressions; y of h and weight."""
    b = boundary_rows(x, residual, post_weight, weight, sum_first)
    y = torch.empty(b.x.shape, dtype=b.norm_dtype, device=x.device)
    if b.x.shape[0]:
        config = config_or_default(configs, "norm_add_norm", fallback="rms_norm")
        run_launch(norm_add_norm_launch(b.x, b.residual, b.post_weight, b.weight, eps, y, b.h, config,
                                        backend_of(x.device), sum_first))
    return y.view(x.shape), b.h.view(x.shape)
