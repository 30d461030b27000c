"""Scatter of a step's new keys and values into the paged cache by slot mapping (slot -1 = skip).

A program moves the `[KVH, D]` key and value rows of `block_m` tokens (each token's rows are one
contiguous run of KVH * D elements in the cache: 16-byte vectors at head dims that are multiples of 8).
An 8-bit cache (hal/common/kv_quant.py) quantizes on the way: per (token, KV head) the scale is the
power of two at or above `absmax / QMAX` (stored as its exponent byte), values `x / scale` rounded to
FP8 as `x * (1 / scale)`: with a power of two both are the exact quotient rounded once, so the stored
bytes equal the torch reference's without a correctly rounded division per element.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.kernels.configs import KernelConfig
from hal.kernels.launch import Launch, backend_of, check_device, launch_options, next_pow2, run_launch
from hal.kernels.pdl import pdl_wait


# a step's size, and where its plane's slots start in the staged array (hal/kernels/launch.py)
@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slot_ptr"])
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_slot, num_tokens,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr,
                     PDL: tl.constexpr = False):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    slots = tl.load(slot_ptr + tokens * stride_slot, mask=token_ok, other=-1).to(tl.int64)   # [T]
    pdl_wait(PDL)             # the slots are the step's metadata (hal/kernels/pdl.py); k and v are not
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (slots >= 0)[:, None, None] & (heads < NUM_KV_HEADS)[None, :, None] \
        & (dims < HEAD_DIM)[None, None, :]
    dst = ((slots // PAGE_SIZE) * stride_cb + (slots % PAGE_SIZE) * stride_ct)[:, None, None] \
        + (heads * stride_ch)[None, :, None] + dims[None, None, :]                       # [T, KVH, D]
    rows = tokens.to(tl.int64)[:, None, None]
    cols = dims[None, None, :]
    k = tl.load(k_ptr + rows * stride_kt + (heads * stride_kh)[None, :, None] + cols, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + rows * stride_vt + (heads * stride_vh)[None, :, None] + cols, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_of(amax, QMAX: tl.constexpr):
    """The scale of a vector whose largest magnitude is `amax`: the least power of two at or above
    `amax / QMAX` (the division correctly rounded, as torch divides; then by the bits, as
    `kv_quant.power_of_two_at_least`), 1 for an all-zero vector (it stores zeros)."""
    ratio = tl.math.div_rn(amax, QMAX)
    bits = ratio.to(tl.int32, bitcast=True)
    exponent = tl.minimum((bits >> 23) + ((bits & 0x7FFFFF) != 0).to(tl.int32), 254)
    exponent = tl.where(ratio > 0.0, exponent, 127)
    return (exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _stored_scale(scale):
    """A power-of-two scale as the cache stores it: its exponent byte (E8M0, hal/common/kv_quant.py)."""
    return (scale.to(tl.int32, bitcast=True) >> 23).to(tl.uint8)


@triton.jit
def _loaded_scale(stored):
    """A stored exponent byte as the float32 scale `2^(byte - 127)` (a masked-off 0 reads as 0.0)."""
    return (stored.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _key_scales(k_scale_ptr, v_scale_ptr, offsets, keys, last_pos, MASKED: tl.constexpr):
    """The float32 K and V scales stored at `offsets` [N] for the keys at positions `keys` [N]; with
    `MASKED`, keys past `last_pos` read 0.0 (what the attention kernels' masked tiles take)."""
    if MASKED:
        valid = keys <= last_pos
        k_scale = _loaded_scale(tl.load(k_scale_ptr + offsets, mask=valid, other=0))
        v_scale = _loaded_scale(tl.load(v_scale_ptr + offsets, mask=valid, other=0))
    else:
        k_scale = _loaded_scale(tl.load(k_scale_ptr + offsets))
        v_scale = _loaded_scale(tl.load(v_scale_ptr + offsets))
    return k_scale, v_scale


@triton.jit
def _inverse(scale):
    """`1 / scale` of a power-of-two scale from its exponent bits, exact: `2^(127 - e)`, and for the
    largest scale (e = 254) the subnormal `2^-127`."""
    exponent = scale.to(tl.int32, bitcast=True) >> 23
    bits = tl.where(exponent < 254, (254 - exponent) << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _quantized(x, inverse, QMAX: tl.constexpr, dtype: tl.constexpr):
    """`x / scale` as `x * inverse` (`_inverse(scale)`, broadcast to x's shape by the caller: the
    product of the exact inverse is the quotient rounded once) clamped to +-QMAX, in the 8-bit `dtype`."""
    return tl.minimum(tl.maximum(x * inverse, -QMAX), QMAX).to(dtype)


@triton.jit
def _quantize_store(x, values_ptrs, scales_ptrs, mask, scale_mask, QMAX: tl.constexpr):
    """x `[T, KVH, D]` fp32 -> FP8 values and one scale per (token, head); returns what the
    cache now holds, dequantized: `[T, KVH, D]` fp32 (values x scale)."""
    scale = _scale_of(tl.max(tl.abs(x), axis=2), QMAX)                                # [T, KVH]
    q = _quantized(x, _inverse(scale)[:, :, None], QMAX, values_ptrs.dtype.element_ty)
    tl.store(values_ptrs, q, mask=mask)
    tl.store(scales_ptrs, _stored_scale(scale), mask=scale_mask)
    return q.to(tl.float32) * scale[:, :, None]


@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["slot_ptr"])
def _kv_write_quant_kernel(k_ptr, v_ptr, k_values_ptr, v_values_ptr, k_scales_ptr, v_scales_ptr, slot_ptr,
                           k_out_ptr, v_out_ptr, stride_slot, num_tokens, stride_kt, stride_kh, stride_vt, stride_vh,
                           stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh,
                           QMAX: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                           HEADS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                           BLOCK_T: tl.constexpr, DEQUANT_OUT: tl.constexpr, PDL: tl.constexpr = False):
    """DEQUANT_OUT: also write what the cache holds, dequantized to k's dtype, to k_out/v_out
    `[T, KVH, D]` (contiguous): a prefill that attends over its fresh K/V reads those (fresh.py)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < num_tokens
    slots = tl.load(slot_ptr + tokens * stride_slot, mask=token_ok, other=-1).to(tl.int64)   # [T]
    pdl_wait(PDL)             # the slots are the step's metadata (hal/kernels/pdl.py); k and v are not
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    scale_mask = (slots >= 0)[:, None] & (heads < NUM_KV_HEADS)[None, :]                     # [T, KVH]
    mask = scale_mask[:, :, None] & (dims < HEAD_DIM)[None, None, :]
    page, offset = slots // PAGE_SIZE, slots % PAGE_SIZE
    dst = (page * stride_cb + offset * stride_ct)[:, None, None] + (heads * stride_ch)[None, :, None] \
        + dims[None, None, :]                                                                  # [T, KVH, D]
    scale_dst = (page * stride_sb + offset * stride_st)[:, None] + (heads * stride_sh)[None, :]  # [T, KVH]
    rows = tokens.to(tl.int64)[:, None, None]
    cols = dims[None, None, :]
    k = tl.load(k_ptr + rows * stride_kt + (heads * stride_kh)[None, :, None] + cols, mask=mask, other=0.0)
    k_held = _quantize_store(k.to(tl.float32), k_values_ptr + dst, k_scales_ptr + scale_dst, mask, scale_mask,
                             QMAX)
    v = tl.load(v_ptr + rows * stride_vt + (heads * stride_vh)[None, :, None] + cols, mask=mask, other=0.0)
    v_held = _quantize_store(v.to(tl.float32), v_values_ptr + dst, v_scales_ptr + scale_dst, mask, scale_mask,
                             QMAX)
    if DEQUANT_OUT:           # every token, written to the cache or not (slot -1 rows are not attended)
        out_mask = token_ok[:, None, None] & (heads < NUM_KV_HEADS)[None, :, None] & (dims < HEAD_DIM)[None, None, :]
        out = rows * (NUM_KV_HEADS * HEAD_DIM) + (heads * HEAD_DIM)[None, :, None] + cols
        tl.store(k_out_ptr + out, k_held.to(k_out_ptr.dtype.element_ty), mask=out_mask)
        tl.store(v_out_ptr + out, v_held.to(v_out_ptr.dtype.element_ty), mask=out_mask)


def kv_write_launch(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    config: KernelConfig, target: str, kv_scales: torch.Tensor | None = None,
                    dequantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> Launch:
    """k, v `[T, KVH, D]`; kv_cache `[2, NB, page, KVH, D]`; slot_mapping `[T]` int64 (one plane).
    `config.block_m` tokens per program. With `kv_scales: [2, NB, page, KVH]` exponent bytes, `kv_cache`
    holds 8-bit values (`hal.common.kv_quant.QuantLayout` views) and the write quantizes; `dequantized`
    (two contiguous `[T, KVH, D]` tensors) then receives K and V as the cache holds them."""
    num_tokens, num_kv_heads, head_dim = k.shape
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    grid = (-(-num_tokens // config.block_m),)
    shape = dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=next_pow2(num_kv_heads),
                 HEAD_DIM_PAD=next_pow2(head_dim), PAGE_SIZE=kv_cache.shape[2], BLOCK_T=config.block_m,
                 **launch_options(config, target))
    strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))
    if kv_scales is None:
        return Launch(_kv_write_kernel, grid, (k, v, key_cache, value_cache, slot_mapping, slot_mapping.stride(0),
                                               num_tokens, *strides), shape)
    from hal.common.kv_quant import quant_max

    k_out, v_out = dequantized if dequantized is not None else (k, v)
    return Launch(_kv_write_quant_kernel, grid, (
        k, v, key_cache, value_cache, kv_scales[0], kv_scales[1], slot_mapping, k_out, v_out, slot_mapping.stride(0),
        num_tokens, *strides, *kv_scales.stride()[1:]), dict(
        QMAX=quant_max(kv_cache.dtype), DEQUANT_OUT=dequantized is not None, **shape))


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             config: KernelConfig, kv_scales: torch.Tensor | None = None,
             dequantize: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Store `k, v: [T, KVH, D]` at `slot_mapping: [T]` of `kv_cache` (in place); -1 skips a token.
    With `kv_scales` (see `kv_write_launch`) the values are quantized, and with `dequantize` the
    K and V the cache now holds come back (k's dtype) from the same launch."""
    check_device(k)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    held = (torch.empty(k.shape, dtype=k.dtype, device=k.device), torch.empty(v.shape, dtype=v.dtype, device=v.device)) \
        if dequantize and kv_scales is not None else None
    if k.shape[0]:
        run_launch(kv_write_launch(k, v, kv_cache, slot_mapping, config, backend_of(k.device), kv_scales, held))
    return held
