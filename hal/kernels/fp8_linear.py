"""FP8-weight linear for GPUs without (or not using) `torch._scaled_mm`: `y = x @ (q * scale).T`
with the weight `q: [N, K]` in FP8 and one float32 scale per output channel, activations in
bf16/fp16/fp32 (W8A16). Also the per-row activation quantization of the `_scaled_mm` path
(`quantize_rows`: one launch where torch needs six).

A program owns a `BLOCK_M x BLOCK_N` tile of y and walks K in steps of `BLOCK_K` (the config's `block_k`,
64 where it has none): the FP8 weight tile is loaded (half the bytes of bf16, which is what decode at
small M is bound by), widened to x's dtype
(exact) and multiplied on the tensor cores with float32 accumulation; the row scales multiply the
accumulator once at the end (they factor out of the sum over K), then the bias. Every product is
exact and only the accumulation order differs from the torch reference (dequantize in float32, then
matmul), so the two agree to float32 rounding for fp32 activations.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.kernels.attention import dot_precision
from hal.kernels.configs import KernelConfig
from hal.kernels.launch import Launch, backend_of, check_device, launch_options, next_pow2, run_launch
from hal.kernels.ops import silu_mul_row

BLOCK_K = 64
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


@triton.jit(do_not_specialize=["num_rows"])      # a step's size (hal/kernels/launch.py)
def _fp8_linear_kernel(out_ptr, x_ptr, w_ptr, scale_ptr, bias_ptr, num_rows, num_cols, num_inner,
                       stride_xm, stride_wn, stride_om, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < num_cols
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm                                # [M, 1]
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn                                # [1, N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(tl.cdiv(num_inner, BLOCK_K)):
        inner = step * BLOCK_K + tl.arange(0, BLOCK_K)
        inner_ok = inner < num_inner
        a = tl.load(x_ptrs + inner[None, :], mask=row_ok[:, None] & inner_ok[None, :], other=0.0)   # [M, K]
        b = tl.load(w_ptrs + inner[:, None], mask=inner_ok[:, None] & col_ok[None, :], other=0.0)   # [K, N]
        acc += tl.dot(a, b.to(a.dtype), input_precision=DOT_PRECISION)
    acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def fp8_linear_launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                      out: torch.Tensor, config: KernelConfig, target: str) -> Launch:
    """x `[M, K]`, weight `[N, K]` FP8, scale `[N]` float32, bias `[N]` or None, out `[M, N]`."""
    rows, inner = x.shape
    cols = weight.shape[0]
    grid = (-(-rows // config.block_m), -(-cols // config.block_n))
    return Launch(_fp8_linear_kernel, grid, (
        out, x, weight, scale, scale if bias is None else bias, rows, cols, inner, x.stride(0), weight.stride(0),
        out.stride(0)), dict(HAS_BIAS=bias is not None, BLOCK_M=max(config.block_m, 16), BLOCK_N=config.block_n,
                             BLOCK_K=config.block_k or BLOCK_K, DOT_PRECISION=dot_precision(x.dtype, target),
                             **launch_options(config, target)))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               config: KernelConfig | None = None) -> torch.Tensor:
    """`x: [M, K]` times FP8 `weight: [N, K]` with row scales `scale: [N]` (+ `bias`) -> `[M, N]` in
    x's dtype (`Hal.op("fp8_linear")`)."""
    check_device(x)
    if weight.dtype not in FP8_DTYPES or scale.dtype != torch.float32 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear takes x [M, K], an FP8 weight [N, K] and float32 scales [N]; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)} {weight.dtype}, scale {scale.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if x.shape[0]:
        config = config or KernelConfig(16, 32, 4, 1)
        w = weight if weight.stride(-1) == 1 else weight.contiguous()      # column views (Huginn's adapter) as they are
        run_launch(fp8_linear_launch(x, w, scale, bias, out, config, backend_of(x.device)))
    return out


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_cols, stride_x, stride_q, QMAX: tl.constexpr,
                          BLOCK: tl.constexpr):
    """One row per program, held whole in registers: `scale = max(absmax, 1e-12) / QMAX`, then
    `clamp(x / scale)` rounded to FP8; both divisions correctly rounded, as torch's."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < num_cols, other=0.0).to(tl.float32)    # [K]
    _store_quantized_row(x, q_ptr + row * stride_q, scale_ptr + row, cols, cols < num_cols, QMAX)


@triton.jit
def _store_quantized_row(x, q_row_ptr, scale_ptr, cols, mask, QMAX: tl.constexpr):
    """x (float32, one row) as FP8 at `cols` and its scale `max(absmax, 1e-12) / QMAX`; both divisions
    correctly rounded, as torch's."""
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), 1e-12), QMAX)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
    tl.store(q_row_ptr + cols, q.to(q_row_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr, scale)


def quantize_rows_launch(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, config: KernelConfig,
                         target: str) -> Launch:
    """x `[M, K]`, out `[M, K]` FP8, scale `[M, 1]` float32; `config.num_warps` per row."""
    from hal.common.kv_quant import quant_max

    return Launch(_quantize_rows_kernel, (x.shape[0],), (x, out, scale, x.shape[1], x.stride(0), out.stride(0)),
                  dict(QMAX=quant_max(out.dtype), BLOCK=next_pow2(x.shape[1]), **launch_options(config, target)))


@triton.jit
def _silu_mul_quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, num_cols, stride_x, stride_q, QMAX: tl.constexpr,
                                   BLOCK: tl.constexpr):
    """`_quantize_rows_kernel` of `silu(gate) * up` for one row of `x = gate | up`, the product rounded to x's
    dtype as the silu_and_mul kernel (hal/kernels/ops.py) stores it: the bytes of the two launches in one."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = silu_mul_row(x_ptr + row * stride_x, cols, mask, num_cols, x_ptr.dtype.element_ty).to(tl.float32)  # [I]
    _store_quantized_row(x, q_ptr + row * stride_q, scale_ptr + row, cols, mask, QMAX)


def silu_mul_quantize_rows_launch(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, config: KernelConfig,
                                  target: str) -> Launch:
    """x `[M, 2I]` (gate | up), out `[M, I]` FP8, scale `[M, 1]` float32; `config.num_warps` per row."""
    from hal.common.kv_quant import quant_max

    return Launch(_silu_mul_quantize_rows_kernel, (x.shape[0],),
                  (x, out, scale, out.shape[1], x.stride(0), out.stride(0)),
                  dict(QMAX=quant_max(out.dtype), BLOCK=next_pow2(out.shape[1]), **launch_options(config, target)))


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                  config: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: [M, K]` -> (`[M, K]` in FP8 `dtype`, float32 scales `[M, 1]`), one scale per row: the
    same bytes as `hal.cuda.fp8.quantize_rows` in torch, in one launch."""
    return _quantized_rows(quantize_rows_launch, x, x.shape[-1], dtype, config)


def silu_mul_quantize_rows(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                           config: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: [M, 2I]` (gate | up) -> `quantize_rows(silu_and_mul(x))` in one launch: the same bytes and scales,
    without the `[M, I]` activation's round trip through memory (the FP8 down projection past the decode
    rows, hal/cuda/fp8.py)."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_mul_quantize_rows needs an even last dim (gate | up), got {tuple(x.shape)}")
    return _quantized_rows(silu_mul_quantize_rows_launch, x, x.shape[-1] // 2, dtype, config)


def _quantized_rows(build, x: torch.Tensor, num_cols: int, dtype: torch.dtype,
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
