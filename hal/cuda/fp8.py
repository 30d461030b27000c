"""FP8 linears on CUDA and ROCm (`Hal.op("fp8_linear")`): `y = x @ (q * scale[:, None]).T`, with the
weight `q: [N, K]` in the Hal's FP8 format and one float32 scale per output channel (zoo/fp8.py).

Three paths, chosen per call from the shapes and dtypes (no device value is read, so graphs capture
each):
- The decode GEMV for 1..8 rows of bf16/fp16: decode at small batch is bound by the weight bytes,
  which FP8 halves. On sm_90 (the table's `gemv_slice_w8a8`) the whole-slice kernel with PDL runs it as
  W8A8 on the FP8 tensor cores, each row of x quantized per 512-wide slice inside the kernel, with no
  launch of its own (hal/kernels/gemv_slice.py; levers 118-122); elsewhere, or where K needs more slices
  than the entry's, W8A16 (the slice kernel for one row, hal/kernels/gemv.py's K-looping kernel for more).
  Ouro-1.4B with FP8 weights and KV on an H100: batch 1 3.26 ms/step against bf16's 4.98, batch 8 6.18.
- W8A8 through `torch._scaled_mm` (NVIDIA sm_89+ only, bf16 activations, K and N multiples of 16):
  each row of x is quantized to e4m3fn on the device (`scale = absmax / 448`; one Triton launch,
  `hal.kernels.fp8_rows.quantize_rows`, which for the down projection also runs SwiGLU:
  `silu_mul_quantize_rows`, lever 131; before q|k|v and gate|up the norm boundary makes those bytes
  itself, `norm_add_norm_fp8`, lever 132, and x comes as `QuantizedRows`), and cuBLASLt runs the
  product on the FP8 tensor cores with row-wise scales on both sides, out in bf16. The activation
  rounding adds error on top of the weights' (docs/fp8.md measures both).
- W8A16 through the Triton kernel of hal/kernels/fp8_linear.py otherwise: FP8 weight tiles widen to
  x's dtype, x is not quantized. ROCm always takes this path: it is the one compile-checked for
  gfx942 (e4m3fnuz) and gfx950.
`LOOPSTACK_FP8_GEMM=triton` (or `scaled_mm`) forces one path for every shape, to compare them on a GPU.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from hal.common.quantized_rows import QuantizedRows

GEMM_ENV = "LOOPSTACK_FP8_GEMM"
GEMM_CHOICES = ("auto", "scaled_mm", "triton")
E4M3_MAX = 448.0
# quantized rows up to this many take the table's `fp8_linear_w8a8` tile where it has one (lever 137):
# at Ouro-1.4B's shapes on an H100 the tile won every product at 32 and 128 rows and lost from 512
W8A8_TILE_MAX_ROWS = 128


def gemm_choice() -> str:
    choice = os.environ.get(GEMM_ENV, "auto")
    if choice not in GEMM_CHOICES:
        raise ValueError(f"{GEMM_ENV}={choice!r}: use one of {', '.join(GEMM_CHOICES)}")
    return choice


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: [M, K]` -> (e4m3fn `[M, K]`, float32 scales `[M, 1]`), one scale per row, on x's device."""
    x32 = x.float()
    scale = x32.abs().amax(-1, keepdim=True).clamp_min(1e-12) / E4M3_MAX         # [M, 1]
    return (x32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None, quantize: Callable[..., Any] | None = None) -> torch.Tensor:
    """W8A8: `x: [M, K]` bf16, e4m3fn `weight: [N, K]`, `scale: [N]` float32 -> `[M, N]` bf16.
    `quantize`: the per-row activation quantization (default: `quantize_rows` in torch)."""
    return scaled_mm_rows(QuantizedRows(*(quantize or quantize_rows)(x), x.dtype), weight, scale, bias)


def scaled_mm_rows(rows: QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 of rows already quantized (`[M, K]` e4m3fn, scales `[M, 1]`) -> `[M, N]` in `rows.dtype`."""
    # weight.t() is [K, N] column-major, the layout cuBLASLt takes for the second operand
    y = torch._scaled_mm(rows.data, weight.t(), scale_a=rows.scale, scale_b=scale.view(1, -1).contiguous(),
                         out_dtype=rows.dtype)
    return y if bias is None else y + bias.to(y.dtype)


def takes_scaled_mm(x: torch.Tensor | QuantizedRows, weight: torch.Tensor) -> bool:
    """Whether `scaled_mm_linear` (`scaled_mm_rows`) takes these operands (dtypes and the 16-multiples
    cuBLASLt needs)."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.float8_e4m3fn
            and x.shape[-1] % 16 == 0 and weight.shape[0] % 16 == 0)


def has_scaled_mm(arch: str) -> bool:
    """Whether `torch._scaled_mm` runs FP8 products on a device of `arch`: NVIDIA sm_89 and later."""
    return arch.startswith("sm_") and int(arch[3:]) >= 89 and hasattr(torch, "_scaled_mm")


def fp8_linear_op(arch: str, configs: dict[str, Any] | None, has_triton: bool) -> Callable[..., Any] | None:
    """The `fp8_linear` op for a device of `arch` ("sm_90", "gfx942"), or None where neither path
    exists (no FP8 there: callers dequantize in torch)."""
    choice = gemm_choice()
    nvidia_fp8 = has_scaled_mm(arch)
    use_scaled_mm = nvidia_fp8 and choice != "triton"
    if choice == "scaled_mm" and not nvidia_fp8:
        raise ValueError(f"{GEMM_ENV}=scaled_mm: torch._scaled_mm needs an NVIDIA GPU of sm_89 or later, "
                         f"this is {arch}; unset {GEMM_ENV}")
    triton_linear, quantize, gemv, w8a8_tile, w8a8_deep = None, None, None, None, None
    if has_triton:
        from hal.kernels import fp8_linear as kernels, fp8_rows
        from hal.kernels.gemv_ops import Gemv

        if choice == "auto":
            gemv = Gemv(configs).fp8_linear
            w8a8_tile = (configs or {}).get("fp8_linear_w8a8")
            w8a8_deep = (configs or {}).get("fp8_linear_w8a8_deep") if w8a8_tile is not None else None

        config, row_config = (configs or {}).get("fp8_linear"), (configs or {}).get("rms_norm")

        def quantize(x):                      # one launch instead of torch's six (per linear, per step)
            return fp8_rows.quantize_rows(x, torch.float8_e4m3fn, row_config)
        if choice != "scaled_mm":
            def triton_linear(x, weight, scale, bias=None):
                return kernels.fp8_linear(x, weight, scale, bias, config)
    if gemv is None and not use_scaled_mm:
        return triton_linear

    def w8a8(rows: QuantizedRows, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        if w8a8_tile is not None and rows.shape[0] <= W8A8_TILE_MAX_ROWS:
            config = w8a8_tile
            if w8a8_deep is not None:
                from hal.kernels.backend import device_compute_units

                config = kernels.w8a8_config(rows.shape[0], weight.shape[0], w8a8_tile, w8a8_deep,
                                             device_compute_units(rows.data.device))
            return kernels.fp8_linear(rows, weight, scale, bias, config)
        return scaled_mm_rows(rows, weight, scale, bias)

    def linear(x: torch.Tensor | QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(x, QuantizedRows):      # made by the kernel before, only where this takes them
            if use_scaled_mm and takes_scaled_mm(x, weight):
                return w8a8(x, weight, scale, bias)
            x = x.dequantize()
        if gemv is not None and bias is None:
            y = gemv(x, weight, scale)
            if y is not None:
                return y
        if use_scaled_mm and takes_scaled_mm(x, weight):
            return w8a8(QuantizedRows(*(quantize or quantize_rows)(x), x.dtype), weight, scale, bias)
        if triton_linear is not None:
            return triton_linear(x, weight, scale, bias)
        return dequantized_linear(x, weight, scale, bias)
    return linear


def silu_mul_fp8_linear_op(arch: str, configs: dict[str, Any] | None, linear: Callable[..., Any],
                           silu_and_mul: Callable[..., Any]) -> Callable[..., Any] | None:
    """The `silu_mul_fp8_linear` op over this Hal's `linear` (`fp8_linear`) and `silu_and_mul`: where
    `linear` would take the W8A16 decode GEMV, SwiGLU runs in that GEMV's prologue and the residual
    add in its epilogue (one launch for the two or three of the unfused path, the same routing, the
    same rounding); where it would take `_scaled_mm`, SwiGLU runs in the activation's quantization
    (`silu_mul_quantize_rows`: one launch for two, the same bytes); other operands run the two ops. None
    where `LOOPSTACK_FP8_GEMM` forces one GEMM: the down projection then stays on it as well, so the
    comparison covers every product."""
    if gemm_choice() != "auto":
        return None
    from hal.kernels.gemv_ops import Gemv

    decode = Gemv(configs)
    fused_quantize = None
    if has_scaled_mm(arch) and configs is not None:
        from hal.kernels import fp8_rows

        row_config = configs.get("silu_mul_quantize_rows") or configs.get("rms_norm")     # an optional entry

        def fused_quantize(gate_up):
            return fp8_rows.silu_mul_quantize_rows(gate_up, torch.float8_e4m3fn, row_config)

    def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        residual: torch.Tensor | None = None) -> torch.Tensor:
        y = decode.silu_mul_fp8_linear(x, weight, scale, residual)
        if y is not None:
            return y
        rows, (n, k) = x.reshape(-1, x.shape[-1]), weight.shape
        if (fused_quantize is not None and not decode.takes(rows.shape[0], k) and x.shape[-1] == 2 * k
                and takes_scaled_mm(rows[:, :k], weight)):
            # `linear` would quantize silu_and_mul's output for its W8A8 product: the same bytes in one launch
            quantized = QuantizedRows(*fused_quantize(rows), rows.dtype)
            y = linear(quantized, weight, scale).view(*x.shape[:-1], n)
            return y if residual is None else residual + y
        act = silu_and_mul(x)
        y = linear(act.reshape(-1, act.shape[-1]), weight, scale).view(*act.shape[:-1], weight.shape[0])
        return y if residual is None else residual + y
    return silu_mul_linear


def norm_add_norm_fp8_op(arch: str, configs: dict[str, Any] | None) -> Callable[..., Any] | None:
    """The `norm_add_norm_fp8` op: `norm_add_norm` (hal/kernels/norms.py) whose normalised rows come out
    quantized for the FP8 product after the boundary (`QuantizedRows`, hal/kernels/fp8_rows.py), where
    `fp8_linear` would quantize them for `_scaled_mm`: past the decode GEMV's rows, bf16, K a multiple of
    16. Elsewhere the op returns None and the caller runs `norm_add_norm`. None where this device has no
    `_scaled_mm`, or `LOOPSTACK_FP8_GEMM` forces the Triton GEMM."""
    if not has_scaled_mm(arch) or configs is None or gemm_choice() == "triton":
        return None
    from hal.kernels import fp8_rows
    from hal.kernels.gemv_ops import Gemv

    decode = Gemv(configs) if gemm_choice() == "auto" else None

    def norm_add_norm_fp8(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                          weight: torch.Tensor, eps: float, sum_first: bool = False
                          ) -> tuple[QuantizedRows, torch.Tensor] | None:
        rows, k = x.numel() // x.shape[-1], x.shape[-1]
        if (decode is not None and decode.takes(rows, k)) or k % 16 or torch.promote_types(
                torch.promote_types(x.dtype, residual.dtype), weight.dtype) != torch.bfloat16:
            return None
        return fp8_rows.norm_add_norm_quantize(x, residual, post_weight, weight, eps, sum_first,
                                               torch.float8_e4m3fn, configs)
    return norm_add_norm_fp8


def dequantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """The plain torch product (weights dequantized to float32), for operands no kernel takes."""
    y = x.float() @ (weight.float() * scale[:, None]).T
    return (y if bias is None else y + bias.float()).to(x.dtype)


# Measured against the bf16 twin in the same run (docs/fp8.md, "Speed"); only archs measured appear,
# and only options slower than bf16 in some measured cell.
SLOWER_THAN_BF16 = {
    "sm_90": {
        "kv": "engine.kv_dtype=fp8 on sm_90 (measured on an H200, 2026-12-03/04): 1.5-1.64x the bf16 tok/s "
              "at 64-128 x 1K for multi-head models (Ouro, Huginn), 1.11-1.19x for grouped-query ones (Nanbeige4.2-3B, "
              "the TMA decode kernel), 0.99-1.0x at batch 1 with short contexts (prompts: level at 128 tokens, "
              "the first token 2-5% sooner at 1,024 on an H100, 2026-12-07): for single short requests "
              "leave engine.kv_dtype unset unless the memory is needed",
        # "weights": none since levers 131-133 (an H100, 2026-12-07): with FP8 weights + KV decode steps of 1-8
        # rows take 0.66-0.74x bf16's time, a 128-token prompt's first token comes 7% sooner than bf16's since
        # lever 139 (7.33 / 7.45 against 7.91 ms; level before), a 1,024-token one 12-16% sooner, an 8K prompt
        # prefills 1.31x faster
    },
}


def speed_notes(arch: str, kv_quantized: bool, fp8_weights: bool) -> list[str]:
    """The measured cases where an FP8 option asked for is slower than bf16 on `arch`."""
    notes = SLOWER_THAN_BF16.get(arch.split(":")[0], {})
    return [notes[key] for key, on in (("kv", kv_quantized), ("weights", fp8_weights)) if on and key in notes]
