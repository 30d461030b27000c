"""Rotary embedding and the KV-cache write in one launch: per token, q's heads are rotated into a
new tensor, k's heads are rotated straight into their cache slot and v's are copied there.

Why: at decode the two ops are a launch each per layer and loop (rotary, then kv_write), each moving
a few KiB; one kernel halves the launches and never writes the rotated k anywhere but the cache.
A prefill without context also needs the rotated k itself (it attends over its fresh K/V,
hal/kernels/fresh.py): `keep_kv` writes it beside the cache, so k and v are read once instead of
twice (8k tokens on the H200: 64 us per layer-plane against 116 for rotary followed by the write),
and v beside it as one contiguous tensor (cuDNN's attention ran 0.548 ms per 8k layer-plane on
contiguous operands against 0.595 on views of the projection: docs/performance.md, lever 100).
The rotation is `hal.kernels.ops`'s own device function, so q and the cached k are bit for bit
those of `rotary` followed by `write_kv`. An 8-bit cache (hal/common/kv_quant.py) gets the same
launch with the write quantizing (`kv_scales`): k rotated and rounded to its dtype, then per (token,
KV head) `scale = absmax / QMAX` and the values divided (`kv_write`'s own device functions),
so the bytes and scales equal those of `rotary` followed by the quantizing `write_kv`.

Grid `(T, groups)`: a token's heads in one program, or spread over a few where the tokens are few
(`ops.rotary_head_groups`); `config.num_warps` warps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.kernels.configs import KernelConfig
from hal.kernels.kv_write import _inverse, _quantized, _scale_of, _stored_scale
from hal.kernels.launch import (EXACT_ROUNDING, Launch, backend_of, check_device, launch_options, next_pow2,
                               run_launch)
from hal.kernels.ops import (
    _inv_freq,
    _rotary_offsets,
    _rotary_one,
    _rotary_program_queries,
    _rotary_values,
    _rotated_head,
    rotary_head_groups,
)


# where its plane's slots start in the staged array: 16-byte aligned or not with the step's size
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _rotary_kv_write_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr, k_cache_ptr, v_cache_ptr,
                            positions_ptr, inv_freq_ptr, slot_ptr, num_heads, num_kv_heads, stride_qt, stride_qh,
                            stride_kt, stride_kh, stride_vt, stride_vh, stride_qot, stride_qoh, stride_kot,
                            stride_koh, stride_cb, stride_ct, stride_ch,
                            PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                            HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                            KV_HEADS_PAD: tl.constexpr, INTERLEAVED: tl.constexpr, KEEP_K: tl.constexpr,
                            KEEP_V: tl.constexpr = False, PDL: tl.constexpr = False):
    """q_out[t] = rotate(q[t]); cache[0][slot[t]] = rotate(k[t]); cache[1][slot[t]] = v[t] (slot -1: no write);
    with KEEP_K also k_out[t] = rotate(k[t]) (strides of k_out), with KEEP_V v_out[t] = v[t] (v_out
    `[T, KVH, D]` contiguous). Program (t, g): query heads [g * HEADS_PAD, ...) and key and value
    heads [g * KV_HEADS_PAD, ...) of token t (`ops.rotary_head_groups`)."""
    slot = tl.load(slot_ptr + tl.program_id(0)).to(tl.int64)          # the step's metadata: before the wait
    token, kv_head, cos, sin = _rotary_program_queries(q_ptr, q_out_ptr, positions_ptr, inv_freq_ptr, num_heads,
                                                       stride_qt, stride_qh, stride_qot, stride_qoh, HALF, HALF_PAD,
                                                       HEADS_PAD, KV_HEADS_PAD, INTERLEAVED, PDL)
    k_ptr += kv_head * stride_kh
    v_ptr += kv_head * stride_vh
    num_kv_heads -= kv_head
    if KEEP_K:
        _rotary_one(k_ptr, k_out_ptr + kv_head * stride_koh, stride_kt, stride_kh, stride_kot, stride_koh, token,
                    cos, sin, num_kv_heads, KV_HEADS_PAD, HALF, HALF_PAD, INTERLEAVED)
    live_heads = tl.where(slot >= 0, num_kv_heads, 0)                  # a skipped token writes no head
    slot = tl.maximum(slot, 0)
    dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_ct + kv_head * stride_ch
    # the cache row is the "token" of the output: stride 0, base at the slot
    _rotary_one(k_ptr, k_cache_ptr + dst, stride_kt, stride_kh, 0, stride_ch, token, cos, sin, live_heads,
                KV_HEADS_PAD, HALF, HALF_PAD, INTERLEAVED)
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < live_heads)[:, None] & (dims < HEAD_DIM)[None, :]
    read = mask
    if KEEP_V:            # every token's v, slot -1 too (the fresh path attends over all of them)
        read = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=read)
    if KEEP_V:
        rows = token * (num_kv_heads + kv_head) * HEAD_DIM + (kv_head + heads) * HEAD_DIM     # [KVH]
        tl.store(v_out_ptr + rows[:, None] + dims[None, :], v, mask=read)
    tl.store(v_cache_ptr + dst + heads[:, None] * stride_ch + dims[None, :], v.to(v_cache_ptr.dtype.element_ty),
             mask=mask)


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _rotary_kv_write_quant_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_values_ptr, v_values_ptr, k_scales_ptr,
                                  v_scales_ptr, positions_ptr, inv_freq_ptr, slot_ptr, k_out_ptr, v_out_ptr,
                                  num_heads, num_kv_heads,
                                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_qot,
                                  stride_qoh, stride_cb, stride_ct, stride_ch, stride_sb, stride_st, stride_sh,
                                  QMAX: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                                  HEAD_DIM_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                                  HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, INTERLEAVED: tl.constexpr,
                                  DEQUANT_OUT: tl.constexpr = False, PDL: tl.constexpr = False):
    """`_rotary_kv_write_kernel` into an 8-bit cache: values `[2, NB, page, KVH, D]` and one exponent byte
    scale per (slot, KV head), `[2, NB, page, KVH]`. DEQUANT_OUT: also K and V as the cache holds
    them, dequantized to k's dtype, into k_out / v_out `[T, KVH, D]` (contiguous), every token (zeros
    for slot -1, which no query attends), as `kv_write`'s own DEQUANT_OUT."""
    slot = tl.load(slot_ptr + tl.program_id(0)).to(tl.int64)          # the step's metadata: before the wait
    token, kv_head, cos, sin = _rotary_program_queries(q_ptr, q_out_ptr, positions_ptr, inv_freq_ptr, num_heads,
                                                       stride_qt, stride_qh, stride_qot, stride_qoh, HALF, HALF_PAD,
                                                       HEADS_PAD, KV_HEADS_PAD, INTERLEAVED, PDL)
    live = tl.where(slot >= 0, num_kv_heads - kv_head, 0)              # a skipped token writes no head
    slot = tl.maximum(slot, 0)
    page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
    heads = tl.arange(0, KV_HEADS_PAD)
    rows = page * stride_cb + offset * stride_ct + (kv_head + heads) * stride_ch           # [KVH]
    scale_rows = page * stride_sb + offset * stride_st + (kv_head + heads) * stride_sh     # [KVH]
    fp8 = k_values_ptr.dtype.element_ty
    first, second, mask = _rotary_values(k_ptr + kv_head * stride_kh, stride_kt, stride_kh, token, cos, sin, live,
                                         KV_HEADS_PAD, HALF, HALF_PAD, INTERLEAVED, k_ptr.dtype.element_ty)
    scale = _scale_of(tl.maximum(tl.max(tl.abs(first), axis=1), tl.max(tl.abs(second), axis=1)), QMAX)
    at_first, at_second = _rotary_offsets(HALF, HALF_PAD, INTERLEAVED)
    inverse = _inverse(scale)[:, None]
    first = _quantized(first, inverse, QMAX, fp8)
    second = _quantized(second, inverse, QMAX, fp8)
    tl.store(k_values_ptr + rows[:, None] + at_first, first, mask=mask)
    tl.store(k_values_ptr + rows[:, None] + at_second, second, mask=mask)
    tl.store(k_scales_ptr + scale_rows, _stored_scale(scale), mask=heads < live)
    if DEQUANT_OUT:       # a fresh prefill attends over these (hal/kernels/fresh.py); slot -1 rows hold 0
        out_rows = token.to(tl.int64) * (num_kv_heads * HEAD_DIM) + (kv_head + heads) * HEAD_DIM        # [KVH]
        out_mask = (heads < num_kv_heads - kv_head)[:, None] & (tl.arange(0, HALF_PAD) < HALF)[None, :]
        dtype = k_out_ptr.dtype.element_ty
        tl.store(k_out_ptr + out_rows[:, None] + at_first, (first.to(tl.float32) * scale[:, None]).to(dtype),
                 mask=out_mask)
        tl.store(k_out_ptr + out_rows[:, None] + at_second, (second.to(tl.float32) * scale[:, None]).to(dtype),
                 mask=out_mask)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < live)[:, None] & (dims < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + token * stride_vt + (kv_head + heads)[:, None] * stride_vh + dims[None, :], mask=mask,
                other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.abs(v), axis=1), QMAX)
    v = _quantized(v, _inverse(scale)[:, None], QMAX, fp8)
    tl.store(v_values_ptr + rows[:, None] + dims[None, :], v, mask=mask)
    tl.store(v_scales_ptr + scale_rows, _stored_scale(scale), mask=heads < live)
    if DEQUANT_OUT:
        out_mask = (heads < num_kv_heads - kv_head)[:, None] & (dims < HEAD_DIM)[None, :]
        tl.store(v_out_ptr + out_rows[:, None] + dims[None, :], (v.to(tl.float32) * scale[:, None]).to(dtype),
                 mask=out_mask)


@triton.jit
def _write_head_kv(k_src, v_src, cos, sin, k_dst, v_dst, k_scale_dst, v_scale_dst, dims,
                   HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, KV_QUANT: tl.constexpr, QMAX: tl.constexpr):
    """One (token, KV head): k rotated (`ops._head_angles`) and v stored at their slot (`k_dst`, `v_dst`: the
    head's values there; an 8-bit cache also its scales), the bytes the two kernels above store, for
    a kernel that holds a head as one vector `dims` `[D_pad]` (hal/kernels/row_decode.py)."""
    valid = dims < HEAD_DIM
    v = tl.load(v_src + dims, mask=valid, other=0.0)
    if KV_QUANT:
        fp8 = k_dst.dtype.element_ty
        k = _rotated_head(k_src, cos, sin, dims, HEAD_DIM // 2, INTERLEAVED, k_src.dtype.element_ty)
        k_scale = _scale_of(tl.max(tl.abs(k), 0), QMAX)
        tl.store(k_dst + dims, _quantized(k, _inverse(k_scale), QMAX, fp8), mask=valid)
        tl.store(k_scale_dst, _stored_scale(k_scale))
        v = v.to(tl.float32)
        v_scale = _scale_of(tl.max(tl.abs(v), 0), QMAX)
        tl.store(v_dst + dims, _quantized(v, _inverse(v_scale), QMAX, fp8), mask=valid)
        tl.store(v_scale_dst, _stored_scale(v_scale))
    else:
        dtype = k_dst.dtype.element_ty
        k = _rotated_head(k_src, cos, sin, dims, HEAD_DIM // 2, INTERLEAVED, dtype)
        tl.store(k_dst + dims, k.to(dtype), mask=valid)
        tl.store(v_dst + dims, v.to(v_dst.dtype.element_ty), mask=valid)


def rotary_kv_write_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           inv_freq: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           q_out: torch.Tensor, interleaved: bool, config: KernelConfig, target: str,
                           k_out: torch.Tensor | None = None, kv_scales: torch.Tensor | None = None,
                           dequantized: tuple[torch.Tensor, torch.Tensor] | None = None,
                           v_out: torch.Tensor | None = None) -> Launch:
    """q `[T, H, D]`, k and v `[T, KVH, D]` (unit stride along D), positions `[T]`, kv_cache
    `[2, NB, page, KVH, D]`, slot_mapping `[T]` int64 (one plane); q_out `[T, H, D]` receives q,
    `k_out` `[T, KVH, D]` (optional) the rotated k, `v_out` (optional, contiguous `[T, KVH, D]`, with
    `k_out` only) v. With `kv_scales: [2, NB, page, KVH]` exponent bytes
    the cache holds 8-bit values and the write quantizes (no `k_out` then); `dequantized` (two
    contiguous `[T, KVH, D]` tensors) then receives K and V as the cache holds them."""
    if dequantized is not None and kv_scales is None:
        raise ValueError("dequantized K/V come back from an 8-bit cache's write only (use k_out)")
    if (k_out is not None or v_out is not None) and kv_scales is not None:
        raise ValueError("the quantizing write hands back K and V as held (dequantized=), not the rotated k")
    if v_out is not None and (k_out is None or not v_out.is_contiguous() or v_out.shape != v.shape):
        raise ValueError("v_out comes back with k_out only, as one contiguous [T, KVH, D] tensor")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    heads, kv_heads, groups = rotary_head_groups(num_tokens, num_heads, num_kv_heads)
    shape = dict(PAGE_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim),
                 HALF=head_dim // 2, HALF_PAD=next_pow2(head_dim // 2), HEADS_PAD=heads, KV_HEADS_PAD=kv_heads,
                 INTERLEAVED=interleaved, **EXACT_ROUNDING, **launch_options(config, target))
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0),
               q_out.stride(1))
    cache_strides = (key_cache.stride(0), key_cache.stride(1), key_cache.stride(2))
    if kv_scales is not None:
        from hal.common.kv_quant import quant_max

        k_held, v_held = dequantized if dequantized is not None else (q_out, q_out)    # unused without
        return Launch(_rotary_kv_write_quant_kernel, (num_tokens, groups), (
            q, k, v, q_out, key_cache, value_cache, kv_scales[0], kv_scales[1], positions, inv_freq, slot_mapping,
            k_held, v_held, num_heads, num_kv_heads, *strides, *cache_strides, *kv_scales.stride()[1:]),
            dict(QMAX=quant_max(kv_cache.dtype), DEQUANT_OUT=dequantized is not None, **shape))
    keep_k, keep_v = k_out is not None, v_out is not None
    k_out = k_out if keep_k else q_out            # unused pointers (KEEP_K/KEEP_V=False compile them away)
    v_out = v_out if keep_v else q_out
    return Launch(_rotary_kv_write_kernel, (num_tokens, groups), (
        q, k, v, q_out, k_out, v_out, key_cache, value_cache, positions, inv_freq, slot_mapping, num_heads,
        num_kv_heads, *strides, k_out.stride(0), k_out.stride(1), *cache_strides),
        dict(KEEP_K=keep_k, KEEP_V=keep_v, **shape))


def rotary_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, theta: float,
                    interleaved: bool, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    config: KernelConfig, keep_kv: bool = False, kv_scales: torch.Tensor | None = None,
                    copy_v: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Rotate `q: [T, H, D]` and `k: [T, KVH, D]` at `positions: [T]` (NeoX halves, or GPT-J pairs
    when `interleaved`), store the rotated k and `v` at `slot_mapping: [T]` of `kv_cache` (-1 skips
    a token) and return the rotated q (a new tensor). With `keep_kv`, `(q, k, v)`: the rotated k as
    a new tensor and `v` itself, or with `copy_v` a contiguous copy of it (cuDNN attends as fast over
    the view: lever 101, docs/performance.md; tools/fresh_rotary_bench.py times both). With
    `kv_scales` (see `rotary_kv_write_launch`) the write quantizes, and `keep_kv` returns k and v as
    the cache now holds them, dequantized (the fresh prefill attends over those: the same K/V a later
    decode step reads)."""
    check_device(q)
    head_dim = q.shape[-1]
    if head_dim % 2 or k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(f"rotary_kv_write needs q, k, v with one even head dim, got {q.shape}, {k.shape}, {v.shape}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    quantized = kv_scales is not None
    k_kept = torch.empty(k.shape, dtype=k.dtype, device=k.device) if keep_kv else None
    # the quantizing write always hands back V as the cache holds it
    v_kept = torch.empty(v.shape, dtype=v.dtype, device=v.device) if keep_kv and (copy_v or quantized) else None
    if q.shape[0]:
        held = (k_kept, v_kept) if quantized and keep_kv else None
        run_launch(rotary_kv_write_launch(q, k, v, positions, _inv_freq(head_dim, float(theta), q.device), kv_cache,
                                          slot_mapping, q_out, interleaved, config, backend_of(q.device),
                                          None if quantized else k_kept, kv_scales, held,
                                          None if quantized else v_kept))
    if not keep_kv:
        return q_out
    return q_out, k_kept, v if v_kept is None else v_kept
