"""Rotary embedding and the KV-cache write in one launch: per token, q's heads are rotated into a
new tensor, k's heads are rotated straight into their cache slot and v's are copied there.

Why: at decode the two ops are a launch each per layer and loop (rotary, then kv_write), each moving
a few KiB; one kernel halves the launches and never writes the rotated k anywhere but the cache.
The rotation is `hal.kernels.ops`'s own device function, so q and the cached k are bit for bit
those of `rotary` followed by `write_kv`. Unquantized caches `[2, NB, page, KVH, D]` only (an 8-bit
cache keeps the two launches: its write quantizes).

Grid `(T,)`: one program per token, `config.num_warps` warps.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.kernels.configs import KernelConfig
from hal.kernels.launch import Launch, backend_of, check_device, launch_options, next_pow2, run_launch
from hal.kernels.ops import _inv_freq, _rotary_angles, _rotary_one


@triton.jit
def _rotary_kv_write_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, inv_freq_ptr,
                            slot_ptr, num_heads, num_kv_heads, stride_qt, stride_qh, stride_kt, stride_kh,
                            stride_vt, stride_vh, stride_qot, stride_qoh, stride_cb, stride_ct, stride_ch,
                            PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                            HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                            KV_HEADS_PAD: tl.constexpr, INTERLEAVED: tl.constexpr):
    """q_out[t] = rotate(q[t]); cache[0][slot[t]] = rotate(k[t]); cache[1][slot[t]] = v[t] (slot -1: no write)."""
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _rotary_angles(positions_ptr, inv_freq_ptr, token, HALF, HALF_PAD)
    _rotary_one(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, cos, sin, num_heads,
                HEADS_PAD, HALF, HALF_PAD, INTERLEAVED)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    live_heads = tl.where(slot >= 0, num_kv_heads, 0)                  # a skipped token writes no head
    slot = tl.maximum(slot, 0)
    dst = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_ct
    # the cache row is the "token" of the output: stride 0, base at the slot
    _rotary_one(k_ptr, k_cache_ptr + dst, stride_kt, stride_kh, 0, stride_ch, token, cos, sin, live_heads,
                KV_HEADS_PAD, HALF, HALF_PAD, INTERLEAVED)
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < live_heads)[:, None] & (dims < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(v_cache_ptr + dst + heads[:, None] * stride_ch + dims[None, :], v.to(v_cache_ptr.dtype.element_ty),
             mask=mask)


def rotary_kv_write_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                           inv_freq: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           q_out: torch.Tensor, interleaved: bool, config: KernelConfig, target: str) -> Launch:
    """q `[T, H, D]`, k and v `[T, KVH, D]` (unit stride along D), positions `[T]`, kv_cache
    `[2, NB, page, KVH, D]`, slot_mapping `[T]` int64 (one plane); q_out `[T, H, D]` receives q."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    return Launch(_rotary_kv_write_kernel, (num_tokens,), (
        q, k, v, q_out, key_cache, value_cache, positions, inv_freq, slot_mapping, num_heads, num_kv_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0),
        q_out.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)), dict(
        PAGE_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, HEAD_DIM_PAD=next_pow2(head_dim), HALF=head_dim // 2,
        HALF_PAD=next_pow2(head_dim // 2), HEADS_PAD=next_pow2(num_heads), KV_HEADS_PAD=next_pow2(num_kv_heads),
        INTERLEAVED=interleaved, **launch_options(config, target)))


def rotary_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, theta: float,
                    interleaved: bool, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    config: KernelConfig) -> torch.Tensor:
    """Rotate `q: [T, H, D]` and `k: [T, KVH, D]` at `positions: [T]` (NeoX halves, or GPT-J pairs
    when `interleaved`), store the rotated k and `v` at `slot_mapping: [T]` of `kv_cache` (-1 skips
    a token) and return the rotated q (a new tensor)."""
    check_device(q)
    head_dim = q.shape[-1]
    if head_dim % 2 or k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        raise ValueError(f"rotary_kv_write needs q, k, v with one even head dim, got {q.shape}, {k.shape}, {v.shape}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0]:
        run_launch(rotary_kv_write_launch(q, k, v, positions, _inv_freq(head_dim, float(theta), q.device), kv_cache,
                                          slot_mapping, q_out, interleaved, config, backend_of(q.device)))
    return q_out
