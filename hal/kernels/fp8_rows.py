"""Activations quantized per row for the FP8 products on `torch._scaled_mm` (W8A8, hal/cuda/fp8.py):
`scale = max(absmax, 1e-12) / QMAX` per row, `q = clamp(x / scale)` rounded to FP8, both divisions
correctly rounded as torch's, so each kernel here makes the bytes `hal.cuda.fp8.quantize_rows` makes in
torch (six launches there). One row per program, held whole in registers.

- `quantize_rows`: rows as they are (o's input, attention's output);
- `silu_mul_quantize_rows`: SwiGLU of `gate | up` first, rounded as the silu_and_mul kernel stores it
  (the down projection's input, lever 131);
- `norm_add_norm_quantize`: a sublayer boundary (hal/kernels/norms.py) whose normalised row, rounded as
  `norm_add_norm` stores it, is quantized in place of being stored (q|k|v's and gate|up's input, lever 132).
Each fused kernel replaces two launches with one and rounds as they do. All three take PDL
(hal/kernels/pdl.py): the product after them (the W8A8 tile, lever 139) launches as they start and loads its
first weight tile while they run (lever 141). The row statistics (sums, maxima) may be summed in another order
than the separate kernels' (the compiler lays each kernel's rows out for its own stores): on an H100 Huginn's
boundary (`sum_first`) moved a last bit of some values that way, Ouro's and the SwiGLU kernel's gave the
separate launches' bytes.
"""
from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl

from hal.common.quantized_rows import QuantizedRows
from hal.kernels.configs import KernelConfig, config_or_default
from hal.kernels.launch import Launch, backend_of, check_device, launch_options, next_pow2, run_launch
from hal.kernels.norms import boundary_launch, boundary_row, boundary_rows
from hal.kernels.ops import silu_mul_row
from hal.kernels.pdl import pdl_wait


@triton.jit
def _store_quantized_row(x, q_row_ptr, scale_ptr, cols, mask, QMAX: tl.constexpr):
    """x (float32, one row) as FP8 at `cols` and its scale `max(absmax, 1e-12) / QMAX`; both divisions
    correctly rounded, as torch's."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), 1e-12), QMAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
    tl.store(q_row_ptr + cols, q.to(q_row_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr, scale)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_cols, stride_x, stride_q, QMAX: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    pdl_wait(PDL)             # x is the kernel before's output (attention's, o's input)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < num_cols, other=0.0).to(tl.float32)    # [K]
    _store_quantized_row(x, q_ptr + row * stride_q, scale_ptr + row, cols, cols < num_cols, QMAX)


@triton.jit
def _silu_mul_quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_cols, stride_x, stride_q, QMAX: tl.constexpr,
                                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """`silu(gate) * up` for one row of `x = gate | up`, rounded to x's dtype as the silu_and_mul kernel
    (hal/kernels/ops.py) stores it, then quantized."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    pdl_wait(PDL)             # gate | up is the kernel before's output
    x = silu_mul_row(x_ptr + row * stride_x, cols, mask, num_cols, x_ptr.dtype.element_ty).to(tl.float32)  # [I]
    _store_quantized_row(x, q_ptr + row * stride_q, scale_ptr + row, cols, mask, QMAX)


@triton.jit
def _norm_add_norm_quantize_kernel(q_ptr, scale_ptr, stride_q, h_ptr, x_ptr, residual_ptr, post_weight_ptr,
                                   weight_ptr, eps, num_cols, stride_x, stride_r, stride_h,
                                   BLOCK: tl.constexpr, X_DTYPE: tl.constexpr, MID_DTYPE: tl.constexpr,
                                   H_DTYPE: tl.constexpr, NORM_DTYPE: tl.constexpr, HAS_POST: tl.constexpr,
                                   SUM_FIRST: tl.constexpr, QMAX: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    y = boundary_row(h_ptr, x_ptr, residual_ptr, post_weight_ptr, weight_ptr, row, cols, mask, eps, num_cols,
                     stride_x, stride_r, stride_h, X_DTYPE, MID_DTYPE, H_DTYPE, NORM_DTYPE, HAS_POST,
                     SUM_FIRST, PDL)
    _store_quantized_row(y.to(tl.float32), q_ptr + row * stride_q, scale_ptr + row, cols, mask, QMAX)


def quantize_rows_launch(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, config: KernelConfig,
                         target: str) -> Launch:
    """x `[M, K]`, out `[M, K]` FP8, scale `[M, 1]` float32; `config.num_warps` per row."""
    from hal.common.kv_quant import quant_max

    return Launch(_quantize_rows_kernel, (x.shape[0],), (x, out, scale, x.shape[1], x.stride(0), out.stride(0)),
                  dict(QMAX=quant_max(out.dtype), BLOCK=next_pow2(x.shape[1]), **launch_options(config, target)))


def silu_mul_quantize_rows_launch(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, config: KernelConfig,
                                  target: str) -> Launch:
    """x `[M, 2I]` (gate | up), out `[M, I]` FP8, scale `[M, 1]` float32; `config.num_warps` per row."""
    from hal.common.kv_quant import quant_max

    return Launch(_silu_mul_quantize_rows_kernel, (x.shape[0],),
                  (x, out, scale, out.shape[1], x.stride(0), out.stride(0)),
                  dict(QMAX=quant_max(out.dtype), BLOCK=next_pow2(out.shape[1]), **launch_options(config, target)))


def norm_add_norm_quantize_launch(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                                  weight: torch.Tensor, eps: float, out: torch.Tensor, scale: torch.Tensor,
                                  h: torch.Tensor, norm_dtype: torch.dtype, config: KernelConfig, target: str,
                                  sum_first: bool = False) -> Launch:
    """hal/kernels/norms.py's `norm_add_norm_launch` with y (`norm_dtype`) quantized into out `[M, N]` FP8
    and scale `[M, 1]` float32."""
    from hal.common.kv_quant import quant_max

    return boundary_launch(_norm_add_norm_quantize_kernel, (out, scale, out.stride(0)), x, residual, post_weight,
                           weight, eps, h, norm_dtype, config, target, sum_first, QMAX=quant_max(out.dtype))


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                  config: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: [M, K]` -> (`[M, K]` in FP8 `dtype`, float32 scales `[M, 1]`), one scale per row."""
    return _quantized_rows(quantize_rows_launch, x, x.shape[-1], dtype, config)


def silu_mul_quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                           config: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: [M, 2I]` (gate | up) -> `quantize_rows(silu_and_mul(x))` in one launch: the same bytes and scales,
    without the `[M, I]` activation's round trip through memory."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul_quantize_rows needs an even last dim (gate | up), got {tuple(x.shape)}")
    return _quantized_rows(silu_mul_quantize_rows_launch, x, x.shape[-1] // 2, dtype, config)


def norm_add_norm_quantize(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                           weight: torch.Tensor, eps: float, sum_first: bool = False,
                           dtype: torch.dtype = torch.float8_e4m3fn,
                           configs: dict[str, KernelConfig] | None = None) -> tuple[QuantizedRows, torch.Tensor]:
    """`(quantize_rows(y), h)` for `(y, h) = norm_add_norm(x, residual, post_weight, weight, eps, sum_first)`
    (hal/kernels/norms.py) in one launch: y's rows in FP8 `dtype` with their scales, `[..., N]` and
    `[..., 1]`, as `QuantizedRows` of y's dtype; h as norm_add_norm returns it."""
    b = boundary_rows(x, residual, post_weight, weight, sum_first)
    out = torch.empty(b.x.shape, dtype=dtype, device=x.device)
    scale = torch.empty(b.x.shape[0], 1, dtype=torch.float32, device=x.device)
    if b.x.shape[0]:
        config = config_or_default(configs, "norm_add_norm", fallback="rms_norm")
        run_launch(norm_add_norm_quantize_launch(b.x, b.residual, b.post_weight, b.weight, eps, out, scale, b.h,
                                                 b.norm_dtype, config, backend_of(x.device), sum_first))
    rows = QuantizedRows(out.view(x.shape), scale.view(*x.shape[:-1], 1), b.norm_dtype)
    return rows, b.h.view(x.shape)


def _quantized_rows(build: Callable[..., Launch], x: torch.Tensor, num_cols: int, dtype: torch.dtype,
                    config: KernelConfig | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`[M, num_cols]` in FP8 `dtype` and float32 scales `[M, 1]` from x `[M, ...]` by the launch `build` makes."""
    check_device(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], num_cols, dtype=dtype, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if x.shape[0]:
        run_launch(build(x, out, scale, config or KernelConfig(1, 1, 4, 1), backend_of(x.device)))
    return out, scale
