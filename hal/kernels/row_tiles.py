"""The row-stream decode kernel's tiles (hal/kernels/row_decode.py): a tile's page lookup, its keys,
values and scales as the cache holds them, and one online-softmax step of the tile's streams.

A tile of `BLOCK_N` keys is loaded `[BLOCK_N, D]` row-major; tile row n belongs to stream n, which
keeps its own running maximum, sum and unnormalised output (row_decode.py's docstring has the
algebra). 8-bit caches: values widen to fp32 in registers, key n's scales multiply its score and its
P; a tile's exponent-byte scales load as words where they lie in aligned runs (`_word_scales_fit`).
Lazy rescale: a stream's reference maximum moves only when a score passes it by more than
2^LAZY_MARGIN, so most tiles skip rescaling the accumulator (H200, bf16 64 x 1K: 152 -> 131 us).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.kernels.attention import _tile_pages
from hal.kernels.kv_write import _key_scales, _loaded_scale

LAZY_MARGIN = tl.constexpr(8.0)     # log2 units: how far a stream's reference maximum may trail its scores


@triton.jit
def _pages(table_ptr, tile, last_pos, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page of `tile`'s keys: one lookup where a tile lies on one page (a scalar), else one per key
    (`attention._tile_pages`, [N]); 0 past the sequence's last key."""
    if PAGE_SIZE % BLOCK_N == 0:
        first = tile * BLOCK_N
        return tl.load(table_ptr + first // PAGE_SIZE, mask=first <= last_pos, other=0).to(tl.int64)
    else:
        return _tile_pages(table_ptr, tile, last_pos, 0, PAGE_SIZE, BLOCK_N, False)


@triton.jit
def _word_scales(scale_ptr, BLOCK_N: tl.constexpr):
    """The `BLOCK_N` exponent bytes from `scale_ptr` (4-byte aligned), loaded as `BLOCK_N / 4` words.
    Why: a lane's 1-byte load is no cp.async candidate; words are, and the pipeliner stages them in
    shared memory with the K/V tiles (sm_90, 16 keys x 1 warp x 3 stages: 8,200 -> 8,264 bytes)."""
    words = tl.load(scale_ptr.to(tl.pointer_type(tl.int32)) + tl.arange(0, BLOCK_N // 4))      # [N / 4]
    stored = (words[:, None] >> (tl.arange(0, 4) * 8)[None, :]) & 0xFF       # [N / 4, 4]: key 4i + j (little-endian)
    return _loaded_scale(tl.reshape(stored, [BLOCK_N]))


@triton.jit
def _load_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, page, head_off, scale_head, tile, last_pos, stride_cb,
               stride_ct, stride_sb, stride_st, dims, dim_valid, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
               MASKED: tl.constexpr, KV_QUANT: tl.constexpr, WORD_SCALES: tl.constexpr = False):
    """Keys and values [tile * BLOCK_N, (tile + 1) * BLOCK_N) on pages `page` [N], as the cache holds
    them, and their scales (8-bit caches; else 1): `(k, v, k_scale, v_scale)`. `MASKED`: keys past
    `last_pos` read as zeros (a last position of -1 reads nothing)."""
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)                          # [N]
    slot = (keys % PAGE_SIZE).to(tl.int64)
    offsets = (page * stride_cb + slot * stride_ct + head_off)[:, None] + dims[None, :]   # [N, D]
    key_valid = keys <= last_pos
    if MASKED:
        mask = key_valid[:, None] & dim_valid[None, :]
    else:
        mask = dim_valid[None, :]
    k = tl.load(k_cache_ptr + offsets, mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offsets, mask=mask, other=0.0)
    if KV_QUANT:
        if WORD_SCALES and not MASKED:       # the tile's scales: one run of BLOCK_N bytes on one page
            first = page * stride_sb + (tile * BLOCK_N) % PAGE_SIZE + scale_head
            k_scale = _word_scales(k_scale_ptr + first, BLOCK_N)
            v_scale = _word_scales(v_scale_ptr + first, BLOCK_N)
        else:                                # one byte (or float32) per key
            scale_off = page * stride_sb + slot * stride_st + scale_head
            k_scale, v_scale = _key_scales(k_scale_ptr, v_scale_ptr, scale_off, keys, last_pos, MASKED)
    else:
        k_scale = tl.full([BLOCK_N], 1.0, tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def _consume_tile(acc, m_i, l_i, q, k, v, k_scale, v_scale, tile, last_pos, BLOCK_N: tl.constexpr,
                  MASKED: tl.constexpr, KV_QUANT: tl.constexpr, LAZY: tl.constexpr):
    """One online-softmax step of the N streams over a tile `_load_tile` read."""
    s = tl.sum(k.to(tl.float32) * q[None, :], 1)                            # [N]
    if KV_QUANT:
        s = s * k_scale
    if MASKED:
        s = tl.where(tile * BLOCK_N + tl.arange(0, BLOCK_N) <= last_pos, s, float("-inf"))
    v = v.to(tl.float32)
    if LAZY and not MASKED:
        # A stream's reference maximum moves only when a score passes it by more than 2^LAZY_MARGIN:
        # p stays <= 2^LAZY_MARGIN, which the fp32 sums hold as exactly, and most tiles skip the
        # rescale of every acc element (a multiply per V value)
        grow = tl.max(s - m_i, 0) > LAZY_MARGIN
    else:
        grow = True
    if grow:
        m_new = tl.maximum(m_i, s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)               # streams without keys yet
        p = tl.exp2(s - m_safe)
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + p
        if KV_QUANT:
            p = p * v_scale
        acc = acc * alpha[:, None] + p[:, None] * v
        m_i = m_new
    else:
        p = tl.exp2(s - m_i)
        l_i = l_i + p
        if KV_QUANT:
            p = p * v_scale
        acc = acc + p[:, None] * v
    return acc, m_i, l_i


@triton.jit
def _stream_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, page, head_off, scale_head,
                 tile, last_pos, stride_cb, stride_ct, stride_sb, stride_st, dims, dim_valid,
                 PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, KV_QUANT: tl.constexpr,
                 LAZY: tl.constexpr, WORD_SCALES: tl.constexpr = False):
    """Keys [tile * BLOCK_N, (tile + 1) * BLOCK_N) on pages `page` [N] into the N streams."""
    k, v, k_scale, v_scale = _load_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, page, head_off, scale_head,
                                        tile, last_pos, stride_cb, stride_ct, stride_sb, stride_st, dims,
                                        dim_valid, PAGE_SIZE, BLOCK_N, MASKED, KV_QUANT, WORD_SCALES)
    return _consume_tile(acc, m_i, l_i, q, k, v, k_scale, v_scale, tile, last_pos, BLOCK_N, MASKED, KV_QUANT,
                         LAZY)


def _word_scales_fit(kv_scales: torch.Tensor | None, page_size: int, block_n: int) -> bool:
    """Whether the kernel loads a tile's exponent bytes as words (`_word_scales`): head-major bytes
    (`QuantLayout`) in aligned runs, a tile on one page, and at least 16 keys. H200, FP8 at 64 / 128 x
    1K, per layer-plane: 16 keys x 1 warp x 3 stages 72.95 -> 69.49 / 140.52 -> 132.65 us with words,
    engine step at 64 x 1K 12.46 -> 12.01 ms; 8 keys x 1 x 3 (the dense entry at 128 x 1K) 129.89 ->
    132.54, step 18.77 -> 18.93 ms: bytes stay there (docs/performance.md, lever 76)."""
    if kv_scales is None or kv_scales.dtype != torch.uint8 or kv_scales.stride(2) != 1:
        return False
    strides = kv_scales.stride()[:2] + kv_scales.stride()[3:]
    aligned = kv_scales.data_ptr() % 4 == 0 and all(stride % 4 == 0 for stride in strides)
    return page_size % block_n == 0 and block_n >= 16 and aligned
