"""Grouped-query decode with the cache's pages fetched by TMA (sm_90): 8-bit and 16-bit caches.

Why a third decode kernel. Grouped queries past a few sequences (Nanbeige4.2-3B: 48 query heads
over 8 KV heads) took the unified kernel (hal/kernels/attention.py), which reads a KV head once for
its group's rows on the tensor cores but, over an FP8 cache, ran at 39% of its floor: 570 sm_90
instructions per 32-key tile, a quarter of them tile addresses (a pointer per element), at 122
registers and four programs of four warps per SM, latency-bound (docs/performance.md, levers 84-86).
Here each page's K and V come as one TMA copy each (a tensor descriptor per cache half: no pointer
tensors, the copy engine fills shared memory), and a program is a single warp, so the tile's
softmax needs no exchange between warps: about 31 instructions per warp and key against 71.

A program owns one (sequence, KV head) and its group's query rows (`BLOCK_M` tensor-core rows,
`GROUP` used) and walks a share of the sequence's pages, `PAGES` per step. An 8-bit cache's values
lie head-major (hal/common/kv_quant.py: a page of one KV head is one `[PAGE, D]` run); a 16-bit
cache's slot-major, so its box is the KV head's `D` columns of the page's rows. The page numbers
come one step ahead, so a step's copies depend on no load of their own step; whole steps run
without masks and only the sequence's last, partial one masks keys (and zeroes their V rows: a
slot never written may hold NaN). Context splits (hal/kernels/splits.py) give the SMs enough
single-warp programs.

8-bit scales (exponent bytes): key n's multiplies score column n. V's enter P: P's column n is
multiplied by 2^(v_exp[n] - v_ref + V_BIAS), where v_ref is the largest V exponent seen so far, so
the accumulator holds the output in units of 2^(v_ref - 127 - V_BIAS) and P stays within fp16 (P <=
2^LAZY_MARGIN). Lazy rescale: the row maxima move only when a score passes them by 2^LAZY_MARGIN and
v_ref only up, so most steps skip rescaling the accumulator; products of powers of two are exact.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.kernels.configs import KernelConfig
from hal.kernels.kv_write import _loaded_scale
from hal.kernels.launch import Launch, launch_options, next_pow2
from hal.kernels.pdl import pdl_wait
from hal.kernels.splits import MAX_SPLITS, reduce_launch, split_parts, split_tiles

FP16_MAX = tl.constexpr(65504.0)
LAZY_MARGIN = tl.constexpr(8.0)     # log2 units: P <= 2^8 between two moves of a row maximum
V_BIAS = tl.constexpr(6)            # P's V factor <= 2^6, so P times it <= 2^14: within fp16
PROGRAMS_PER_UNIT = 8               # single-warp programs per SM the context split aims at


@triton.jit
def _page(q, k_desc, v_desc, k_scale_ptr, v_scale_ptr, page, kv_head, keys, seq_len, qk_scale,
          NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, KV_QUANT: tl.constexpr,
          MASKED: tl.constexpr):
    """One page of one KV head: scores `[M, PAGE]` in log2 units, its V `[PAGE, D]` as the PV product
    takes it, and (8-bit caches) its V exponents. `MASKED` (the sequence's last tile): keys past the
    sequence score -inf, and their V rows and exponents are 0 (a slot never written may hold NaN).
    8-bit values lie head-major (the page's rows of a head are one run), 16-bit ones slot-major
    (the box takes the head's columns of the page's rows)."""
    valid = keys < seq_len
    if KV_QUANT:
        slot = page * NUM_KV_HEADS + kv_head
        k = k_desc.load([slot * PAGE, 0]).to(tl.float16)
        v = v_desc.load([slot * PAGE, 0]).to(tl.float16)
        k_scale = _loaded_scale(tl.load(k_scale_ptr + slot * PAGE + tl.arange(0, PAGE)))
        v_exp = tl.load(v_scale_ptr + slot * PAGE + tl.arange(0, PAGE)).to(tl.int32)
        s = tl.dot(q, tl.trans(k)) * (k_scale * qk_scale)[None, :]
    else:
        k = k_desc.load([page * PAGE, kv_head * HEAD_DIM])
        v = v_desc.load([page * PAGE, kv_head * HEAD_DIM])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        v_exp = tl.zeros([PAGE], tl.int32)
    if MASKED:
        s = tl.where(valid[None, :], s, float("-inf"))
        v = tl.where(valid[:, None], v, 0.0).to(v.dtype)
        v_exp = tl.where(valid, v_exp, 0)
    return s, v, v_exp


@triton.jit
def _pow2(exponent):
    """2^(exponent - 127) as float32, exactly (0 below the normal range)."""
    return (tl.maximum(exponent, 0) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _tile(acc, m_i, l_i, v_ref, q, k_desc, v_desc, k_scale_ptr, v_scale_ptr, page0, page1, kv_head, tile, seq_len,
          qk_scale, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PAGES: tl.constexpr,
          KV_QUANT: tl.constexpr, MASKED: tl.constexpr):
    """One step of `PAGES` pages: the online softmax with lazy references (module docstring)."""
    keys = tile * PAGES * PAGE + tl.arange(0, PAGE)
    s0, v0, e0 = _page(q, k_desc, v_desc, k_scale_ptr, v_scale_ptr, page0, kv_head, keys, seq_len, qk_scale,
                       NUM_KV_HEADS, HEAD_DIM, PAGE, KV_QUANT, MASKED)
    tile_max = tl.max(s0, 1)
    tile_exp = tl.max(e0, 0)
    if PAGES == 2:
        s1, v1, e1 = _page(q, k_desc, v_desc, k_scale_ptr, v_scale_ptr, page1, kv_head, keys + PAGE,
                           seq_len, qk_scale, NUM_KV_HEADS, HEAD_DIM, PAGE, KV_QUANT, MASKED)
        tile_max = tl.maximum(tile_max, tl.max(s1, 1))
        tile_exp = tl.maximum(tile_exp, tl.max(e1, 0))
    m_new = tl.where(tile_max > m_i + LAZY_MARGIN, tile_max, m_i)
    v_new = tl.maximum(v_ref, tile_exp)
    if (tl.max(m_new - m_i, 0) > 0.0) | (v_new > v_ref):
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * (alpha * _pow2(v_ref - v_new + 127))[:, None]
        m_i = m_new
        v_ref = v_new
    p0 = tl.exp2(s0 - m_i[:, None])
    l_i += tl.sum(p0, 1)
    acc = tl.dot(_weighted(p0, e0, v_ref, v0.dtype, KV_QUANT), v0, acc)
    if PAGES == 2:
        p1 = tl.exp2(s1 - m_i[:, None])
        l_i += tl.sum(p1, 1)
        acc = tl.dot(_weighted(p1, e1, v_ref, v1.dtype, KV_QUANT), v1, acc)
    return acc, m_i, l_i, v_ref


@triton.jit
def _weighted(p, v_exp, v_ref, dtype: tl.constexpr, KV_QUANT: tl.constexpr):
    """P as the PV product takes it: times each key's V factor 2^(v_exp - v_ref + V_BIAS) for 8-bit caches."""
    if KV_QUANT:
        p = p * _pow2(v_exp - v_ref + 127 + V_BIAS)[None, :]
    return p.to(dtype)


@triton.jit
def _gqa_decode_kernel(
        out_ptr, q_ptr, k_desc, v_desc, k_scale_ptr, v_scale_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
        part_out_ptr, part_max_ptr, part_sum_ptr, qk_scale, num_tokens,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr, PAGES: tl.constexpr, NUM_SPLITS: tl.constexpr, HEADS_FIRST: tl.constexpr,
        KV_QUANT: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) == token:        # graph padding: no query this step
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None], other=0.0)
    if KV_QUANT:                                        # FP8 -> fp16 is one packed conversion; bf16 two
        q = tl.clamp(q.to(tl.float32), -FP16_MAX, FP16_MAX).to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)        # output in units of 2^(v_ref - 127 - V_BIAS)
    v_ref = tl.zeros([], tl.int32)
    num_pages = tl.cdiv(seq_len, PAGE)
    num_tiles = tl.cdiv(num_pages, PAGES)
    tile_lo, tile_hi = split_tiles(num_tiles, split, NUM_SPLITS)
    table = block_table_ptr + seq.to(tl.int64) * stride_bt
    num_whole = seq_len // (PAGES * PAGE)                   # tiles without keys past the sequence
    page0 = tl.load(table + tile_lo * PAGES, mask=tile_lo * PAGES < num_pages, other=0)
    page1 = tl.load(table + tile_lo * PAGES + 1, mask=tile_lo * PAGES + 1 < num_pages, other=0)
    for tile in range(tile_lo, tl.minimum(tile_hi, num_whole)):
        ahead = (tile + 1) * PAGES
        next0 = tl.load(table + ahead, mask=ahead < num_pages, other=0)
        next1 = tl.load(table + ahead + 1, mask=ahead + 1 < num_pages, other=0)
        acc, m_i, l_i, v_ref = _tile(acc, m_i, l_i, v_ref, q, k_desc, v_desc, k_scale_ptr, v_scale_ptr, page0, page1,
                                     kv_head, tile, seq_len, qk_scale, NUM_KV_HEADS, HEAD_DIM, PAGE, PAGES,
                                     KV_QUANT, False)
        page0 = next0
        page1 = next1
    if (tile_lo <= num_whole) & (num_whole < tile_hi):     # the partial last tile, in the split that has it
        first = num_whole * PAGES
        page0 = tl.load(table + first)
        page1 = tl.load(table + first + 1, mask=first + 1 < num_pages, other=0)
        acc, m_i, l_i, v_ref = _tile(acc, m_i, l_i, v_ref, q, k_desc, v_desc, k_scale_ptr, v_scale_ptr, page0, page1,
                                     kv_head, num_whole, seq_len, qk_scale, NUM_KV_HEADS, HEAD_DIM, PAGE, PAGES,
                                     KV_QUANT, True)
    if KV_QUANT:
        acc = acc * _pow2(v_ref - V_BIAS)

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
    else:
        part_row = (split * num_tokens + token.to(tl.int64)) * (NUM_KV_HEADS * GROUP) + heads      # [M]
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(part_max_ptr + part_row, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_valid)


def fits(q: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None, max_query_len: int) -> bool:
    """Whether this kernel takes the batch: one new token per sequence, grouped queries, a head dim
    TMA copies whole (a power of two, 16-256 elements), pages of at least 16 keys, a Triton with
    tensor descriptors, 16-bit queries (float32 runs keep the unified kernel's fp32 products), and
    either an FP8 cache with exponent-byte scales and head-major values (each page of a KV head one
    `[PAGE, D]` run) or a slot-major 16-bit cache of q's dtype."""
    if max_query_len != 1 or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    num_heads, head_dim = q.shape[1:]
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    if num_heads == num_kv_heads or num_heads % num_kv_heads or num_heads // num_kv_heads > 16:
        return False
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256 or page_size not in (16, 32, 64):
        return False                # pages past 64 keys: tiles too large for the stages in shared memory
    if kv_scales is None:
        if kv_cache.dtype != q.dtype:
            return False
        if not all(kv_cache[i].is_contiguous() for i in (0, 1)):
            return False
    elif kv_scales.dtype != torch.uint8 or not all(
            _pages_of(kv_cache[i]).is_contiguous() and kv_scales[i].transpose(1, 2).is_contiguous() for i in (0, 1)):
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def num_splits(num_seqs: int, num_kv_heads: int, num_compute_units: int, config: KernelConfig) -> int:
    """Context splits: `config.split_k` where set, else a power of two giving about PROGRAMS_PER_UNIT
    single-warp programs per compute unit (H200, FP8 at Nanbeige's 64 x 1K, 512 programs: 2 splits
    55.5 us per layer-plane, 4 65.6, 8 72.6; docs/performance.md lever 86)."""
    if config.split_k > 0:
        return min(config.split_k, MAX_SPLITS)
    wanted = PROGRAMS_PER_UNIT * num_compute_units // max(num_seqs * num_kv_heads, 1)
    return min(next_pow2(wanted + 1) // 2 if wanted > 1 else 1, MAX_SPLITS)


def _pages_of(half: torch.Tensor) -> torch.Tensor:
    """`[NB, page, KVH, D]` values of one half -> `[NB, KVH, page, D]` (contiguous when head-major)."""
    return half.transpose(1, 2)


def gqa_decode_launches(q: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
                        block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float, config: KernelConfig, reduce_config: KernelConfig, out: torch.Tensor,
                        target: str, num_compute_units: int) -> list[Launch]:
    """The launches of one decode step's attention (check `fits` first); arguments as
    hal.kernels.attention.attention_launches takes them (kv_scales the exponent bytes' view, None for a
    16-bit cache)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from hal.kernels.attention import LOG2E

    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    pages = max(config.block_n // page_size, 1)
    if pages > 2:
        raise ValueError(f"attention_decode_tma: block_n {config.block_n} must be one or two pages of "
                         f"{page_size} keys")
    splits = num_splits(num_seqs, num_kv_heads, num_compute_units, config)
    if kv_scales is None:     # slot-major rows [NB * page, KVH * D]: a box is a head's columns of a page
        descs = [TensorDescriptor.from_tensor(kv_cache[i].reshape(-1, num_kv_heads * head_dim),
                                              [page_size, head_dim]) for i in (0, 1)]
        scales = [kv_cache[0], kv_cache[1]]                                   # never read (KV_QUANT False)
    else:                     # head-major rows [NB * KVH * page, D]: a box is a whole run
        descs = [TensorDescriptor.from_tensor(_pages_of(kv_cache[i]).reshape(-1, head_dim),
                                              [page_size, head_dim]) for i in (0, 1)]
        scales = [kv_scales[i].transpose(1, 2) for i in (0, 1)]             # [NB, KVH, page], contiguous
    parts = split_parts(q, splits, head_dim)
    grid = (num_kv_heads, num_seqs, splits) if config.heads_first else (num_seqs, num_kv_heads, splits)
    main = Launch(_gqa_decode_kernel, grid, (
        out, q, *descs, *scales, block_table, seq_lens, query_start_loc, *parts, scale * LOG2E, num_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0)), dict(
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, PAGE=page_size,
        BLOCK_M=max(next_pow2(group), 16), PAGES=pages, NUM_SPLITS=splits, HEADS_FIRST=bool(config.heads_first),
        KV_QUANT=kv_scales is not None, **launch_options(config, target)))
    if splits == 1:
        return [main]
    return [main, reduce_launch(out, parts, reduce_config, target)]
