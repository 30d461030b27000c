"""Decode attention for one query row per program (one new token per sequence): the keys' softmax
streams run side by side in a program's lanes, without `tl.dot`.

Why a second kernel. The unified kernel (hal/kernels/attention.py) puts a program's query rows on the
tensor cores, which take at least 16 rows: for multi-head decode 15 of them are padding, and an 8-bit
V tile can only reach them through byte-wise shared-memory reads (no transposing load exists for
8-bit data on sm_90), which left FP8 decode slower than bf16 (docs/performance.md, levers 21-24).
Here a program owns one (sequence, query head) and walks its KV head's keys in tiles of `BLOCK_N`:
the tile is loaded `[BLOCK_N, D]` row-major, as it lies in the cache; QK^T is a product and a sum along D (within a few
lanes); and every tile row n keeps its own online softmax: its running maximum m[n], sum l[n] and
unnormalised output acc[n, :]. Tile row n of every tile belongs to stream n, so a tile needs no
exchange between lanes except the sum along D, and the streams merge once at the end (the same
algebra as the context split): out = sum_n 2^(m[n] - M) acc[n] / sum_n 2^(m[n] - M) l[n].

A tile's loads and its softmax step are hal/kernels/row_tiles.py's (8-bit caches: values widen to
fp32 in registers; key n's scales multiply its score and its P before the PV accumulation, the sums
stay the unscaled P's; the lazy rescale of each stream's maximum).

Grid `(num_heads, num_seqs, NUM_SPLITS)`, heads fastest: the programs of one sequence's heads run side
by side over the same cache rows (a slot's row holds every head's values; H200, 128 x 1K over FP8:
212 -> 187 us per layer-plane against sequences fastest, when the scales still lay in the rows too).
A tile's values and scales are one contiguous run each per KV head (hal/common/kv_quant.py; the
scales exponent bytes, which tiles of 16 keys or more load as words: lever 76) and a tile of at most a
page looks its page up once (`_pages`): per tile, not per key (levers 70, 74). Sequences
without exactly one query this step (graph padding; in a mixed batch, the prompt chunks the unified
kernel takes: `attend.launches_for`) return at once; with `NUM_SPLITS > 1` the partials go to
hal/kernels/splits.py's reduce. At two stages the pages of a tile come from the block table one
iteration ahead, as in the unified kernel (its lever 22); with more, each tile reads its own and the
pipeliner keeps several tiles in flight (a page carried from the iteration before tied every load to
it: 3 stages had run at half speed).
Used by every multi-head decode on sm_90 since 2026-12-02 (docs/performance.md, levers 25-26, 43-44).

Grouped queries (`GROUP` query heads per KV head): each query head keeps its own program and reads
its KV head's keys, so a group reads them `GROUP` times, from L2 after the first (the group's
programs are neighbours in the grid). That pays only where the batch is small enough that the
context splits anyway (hal/kernels/attend.py); larger batches keep the unified kernel, which reads a
KV head once for the whole group on the tensor cores.

`ROTARY` (small batches, `attend.fuses_rotary`): q arrives unrotated and this step's k and v are not
in the cache yet. Every program rotates its q row itself (`ops._rotated_head`: the rotary kernel's
values to the bit); the program whose split holds the sequence's last key rotates k and stores k and
v at the token's slot (`rotary_kv._write_head_kv`: the bytes rotary_kv.py stores, an 8-bit cache's
scales too; with grouped queries every program of the group stores the same bytes, so none reads the
slot before its own store) and, after a barrier, reads them back as any other key. One launch per layer-plane
fewer: Ouro-1.4B batch 1 on the H200 4.66 -> 4.60 ms (lever 58). The same bytes on the H200 since
both kernels compile without floating-point contraction (`launch.EXACT_ROUNDING`, lever 66).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hal.kernels.attention import LOG2E
from hal.kernels.configs import KernelConfig
from hal.kernels.launch import EXACT_ROUNDING, Launch, launch_options, next_pow2
from hal.kernels.ops import _head_angles, _rotated_head
from hal.kernels.pdl import pdl_wait
from hal.kernels.rotary_kv import _write_head_kv
from hal.kernels.row_tiles import _consume_tile, _load_tile, _pages, _stream_tile, _word_scales_fit
from hal.kernels.splits import reduce_launch, split_parts, split_tiles

@triton.jit
def _row_decode_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq_lens_ptr,
        query_start_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, qk_scale, num_tokens,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
        stride_sb, stride_st, stride_sh, k_new_ptr, v_new_ptr, positions_ptr, inv_freq_ptr, slot_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, KV_QUANT: tl.constexpr, NUM_STAGES: tl.constexpr,
        ROTARY: tl.constexpr = False, INTERLEAVED: tl.constexpr = False, QMAX: tl.constexpr = 0.0,
        LAZY: tl.constexpr = True, GROUP: tl.constexpr = 1, WORD_SCALES: tl.constexpr = False,
        PDL: tl.constexpr = False):
    head = tl.program_id(0)
    kv_head = head // GROUP
    seq = tl.program_id(1)
    split = tl.program_id(2)
    # Before the wait, what no kernel of this step writes (hal/kernels/pdl.py): the batch's metadata
    # (copied in before the step), the rotary angles, and the keys before this step's one, which
    # earlier steps stored; so the split's first tile is on its way while the predecessor drains
    token = tl.load(query_start_ptr + seq)
    # no query this step (graph padding), or a prompt chunk of a mixed batch (the unified kernel's)
    is_padding = tl.load(query_start_ptr + seq + 1) - token != 1
    token = token.to(tl.int64)
    last_pos = tl.load(seq_lens_ptr + seq) - 1               # the query sees keys 0 .. last_pos
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    num_full = (last_pos + 1) // BLOCK_N
    tile_lo, tile_hi = split_tiles(tl.cdiv(last_pos + 1, BLOCK_N), split, NUM_SPLITS)
    full_hi = tl.minimum(tile_hi, num_full)
    table_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_ch
    scale_head = kv_head.to(tl.int64) * stride_sh
    early = (tile_lo < full_hi) & ((tile_lo + 1) * BLOCK_N <= last_pos)    # keys before this step's only
    page = _pages(table_ptr, tile_lo, last_pos, PAGE_SIZE, BLOCK_N)
    early_last = tl.where(early, last_pos, -1)
    k0, v0, k0_scale, v0_scale = _load_tile(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, page, head_off,
                                            scale_head, tile_lo, early_last, stride_cb, stride_ct, stride_sb, stride_st,
                                            dims, dim_valid, PAGE_SIZE, BLOCK_N, True, KV_QUANT)
    first = tile_lo + early.to(tl.int32)                     # the first tile the loop below reads
    page = _pages(table_ptr, first, last_pos, PAGE_SIZE, BLOCK_N)
    if ROTARY:
        cos, sin = _head_angles(tl.load(positions_ptr + token), inv_freq_ptr, dims, HEAD_DIM // 2, INTERLEAVED)
        slot = tl.load(slot_ptr + token)
    pdl_wait(PDL)
    if is_padding:
        return
    q_src = q_ptr + token * stride_qt + head * stride_qh
    if ROTARY:
        q = _rotated_head(q_src, cos, sin, dims, HEAD_DIM // 2, INTERLEAVED, q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_src + dims, mask=dim_valid, other=0.0).to(tl.float32)
    q = q * qk_scale                                                        # [D], scores in the log2 domain

    if ROTARY:
        # this step's key and value: the split that reads the last key stores them first (the bytes
        # of rotary_kv.py's write), then reads them back as any other key
        last_tile = last_pos // BLOCK_N
        if (tile_lo <= last_tile) & (last_tile < tile_hi) & (slot >= 0):
            slot_page, slot_offset = slot // PAGE_SIZE, slot % PAGE_SIZE
            row = slot_page * stride_cb + slot_offset * stride_ct + kv_head.to(tl.int64) * stride_ch
            scale_row = slot_page * stride_sb + slot_offset * stride_st + scale_head
            _write_head_kv(k_new_ptr + token * stride_kt + kv_head * stride_kh,
                           v_new_ptr + token * stride_vt + kv_head * stride_vh, cos, sin,
                           k_cache_ptr + row, v_cache_ptr + row, k_scale_ptr + scale_row, v_scale_ptr + scale_row,
                           dims, HEAD_DIM, INTERLEAVED, KV_QUANT, QMAX)
            tl.debug_barrier()                               # the stores are visible to the program's loads

    m_i = tl.full([BLOCK_N], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_N, HEAD_DIM_PAD], tl.float32)
    # the early tile (no keys where it was not read: its streams stay empty, no branch around it)
    acc, m_i, l_i = _consume_tile(acc, m_i, l_i, q, k0, v0, k0_scale, v0_scale, tile_lo, early_last, BLOCK_N,
                                  True, KV_QUANT, LAZY)
    if NUM_STAGES <= 2:
        # one K/V tile in flight: the next tile's pages are loaded a tile ahead, by hand
        for tile in tl.range(first, full_hi, num_stages=NUM_STAGES):
            next_page = _pages(table_ptr, tile + 1, last_pos, PAGE_SIZE, BLOCK_N)
            acc, m_i, l_i = _stream_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                         page, head_off, scale_head, tile, last_pos, stride_cb, stride_ct,
                                         stride_sb, stride_st, dims, dim_valid, PAGE_SIZE, BLOCK_N, False,
                                         KV_QUANT, LAZY, WORD_SCALES)
            page = next_page
    else:
        # several tiles in flight: a page carried from the iteration before would tie every load to
        # the previous iteration, so each tile reads its pages and the pipeliner runs those loads ahead
        for tile in tl.range(first, full_hi, num_stages=NUM_STAGES):
            page = _pages(table_ptr, tile, last_pos, PAGE_SIZE, BLOCK_N)
            acc, m_i, l_i = _stream_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                         page, head_off, scale_head, tile, last_pos, stride_cb, stride_ct,
                                         stride_sb, stride_st, dims, dim_valid, PAGE_SIZE, BLOCK_N, False,
                                         KV_QUANT, LAZY, WORD_SCALES)
    if tile_hi > num_full and tile_hi > tile_lo:             # the sequence's last, partial tile
        tile = tile_hi - 1
        page = _pages(table_ptr, tile, last_pos, PAGE_SIZE, BLOCK_N)
        acc, m_i, l_i = _stream_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, page,
                                     head_off, scale_head, tile, last_pos, stride_cb, stride_ct, stride_sb,
                                     stride_st, dims, dim_valid, PAGE_SIZE, BLOCK_N, True, KV_QUANT, LAZY)

    m_all = tl.max(m_i, 0)
    weight = tl.exp2(m_i - tl.where(m_all == float("-inf"), 0.0, m_all))    # empty streams weigh 0
    l_all = tl.sum(l_i * weight, 0)
    out = tl.sum(acc * weight[:, None], 0)                                  # [D]
    if NUM_SPLITS == 1:
        out = out / tl.where(l_all > 0.0, l_all, 1.0)
        tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
                 mask=dim_valid)
    else:
        part_row = (split * num_tokens + token) * tl.num_programs(0) + head
        tl.store(part_out_ptr + part_row * HEAD_DIM_PAD + dims, out)
        tl.store(part_max_ptr + part_row, m_all)
        tl.store(part_sum_ptr + part_row, l_all)


class NewKV(NamedTuple):
    """This step's k and v before rotary, for the row kernel to rotate and store itself (with q)."""
    k: torch.Tensor                 # [T, H, D], unit stride along D
    v: torch.Tensor                 # [T, H, D]
    positions: torch.Tensor         # [T]
    inv_freq: torch.Tensor          # [D / 2] float32 (hal.kernels.ops._inv_freq)
    slot_mapping: torch.Tensor      # [T] int64, the plane's; -1 stores nothing
    interleaved: bool               # GPT-J pairs, else NeoX halves


def row_decode_launches(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        config: KernelConfig, num_splits: int, reduce_config: KernelConfig,
                        out: torch.Tensor, target: str, kv_scales: torch.Tensor | None = None,
                        new_kv: NewKV | None = None) -> list[Launch]:
    """The launches of one decode attention call with at most one query per sequence (query heads a
    multiple of the KV heads); arguments as `hal.kernels.attention.attention_launches`. With `new_kv`,
    q is not rotated yet and the cache lacks this step's keys: the kernel rotates q, and the split
    that reads a sequence's last key rotates and stores k and v first (one launch fewer than
    `rotary_kv.rotary_kv_write` before it; its bytes, up to the ulp the module docstring names)."""
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"row decode attention takes a whole number of query heads per KV head, got "
                         f"{num_heads} query heads over {num_kv_heads} KV heads")
    head_dim_pad = max(next_pow2(head_dim), 16)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    k_scales, v_scales = (key_cache, value_cache) if kv_scales is None else (kv_scales[0], kv_scales[1])
    scale_strides = (0, 0, 0) if kv_scales is None else kv_scales.stride()[1:]
    rotary, qmax = {}, {}
    if new_kv is not None:
        if head_dim % 2 or new_kv.k.stride(-1) != 1 or new_kv.v.stride(-1) != 1:
            raise ValueError("the row kernel's rotary takes an even head dim and k, v with unit stride along D")
        fresh = (new_kv.k, new_kv.v, new_kv.positions, new_kv.inv_freq, new_kv.slot_mapping,
                 new_kv.k.stride(0), new_kv.k.stride(1), new_kv.v.stride(0), new_kv.v.stride(1))
        rotary = dict(ROTARY=True, INTERLEAVED=new_kv.interleaved, **EXACT_ROUNDING)
        if kv_scales is not None:
            from hal.common.kv_quant import quant_max

            qmax = dict(QMAX=quant_max(kv_cache.dtype))
    else:
        fresh = (q, q, q, q, q, 0, 0, 0, 0)           # unused pointers (ROTARY=False compiles them away)
    parts = split_parts(q, num_splits, head_dim_pad)
    main = Launch(_row_decode_kernel, (num_heads, seq_lens.shape[0], num_splits), (
        out, q, key_cache, value_cache, k_scales, v_scales, block_table, seq_lens, query_start_loc, *parts,
        scale * LOG2E, num_tokens, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        *scale_strides, *fresh), dict(
        PAGE_SIZE=page_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_N=config.block_n,
        NUM_SPLITS=num_splits, KV_QUANT=kv_scales is not None, NUM_STAGES=config.num_stages,
        WORD_SCALES=_word_scales_fit(kv_scales, page_size, config.block_n),
        GROUP=num_heads // num_kv_heads, **rotary, **qmax, **launch_options(config, target)))
    if num_splits == 1:
        return [main]
    return [main, reduce_launch(out, parts, reduce_config, target)]
