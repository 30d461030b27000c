"""Paged attention over `[2, num_blocks, page_size, KVH, D]` caches: prefill, chunked prefill and
decode of many sequences in one launch ("unified" attention), GQA-aware, with an optional split of
the context over several programs (flash-decoding) and a reduce.

Tiling. A program owns one KV head of one sequence and a block of `BLOCK_Q` consecutive query
tokens; its `BLOCK_M = BLOCK_Q * G` query rows are those tokens times the G query heads that share
the KV head, so every K/V tile is loaded once for all of them. It walks the keys in tiles of
`BLOCK_N` (any multiple or fraction of the page size: every key looks its page up in the block
table) with an online softmax in fp32 (base 2, scale folded into `qk_scale`). Tiles entirely below
the causal diagonal run without masks; only the last tiles of a block mask keys. Head dims that are
not powers of two are padded to `HEAD_DIM_PAD` with masked loads.

Grid `(num_tokens // BLOCK_Q + num_seqs, KVH, NUM_SPLITS)`: an upper bound on the number of query
blocks; each program finds its sequence by binary search over `query_start_loc` and programs past
the end of a sequence return at once. With `NUM_SPLITS > 1` (decode-like batches) program `s` of a
block handles the s-th share of its key tiles and writes an unnormalised partial result, its row
maxima and row sums; hal/kernels/splits.py merges them. The grid depends only on host integers (number
of tokens, sequences, splits): CUDA/HIP graphs stay valid as long as a captured bucket keeps
`num_tokens`, `num_seqs` and `max_query_len` (which picks the config and the split) fixed.

Precision: products on the tensor cores with fp32 accumulation; bf16 P for the PV product (as in
FlashAttention); fp32 caches use 3xTF32 on NVIDIA and fp32 MFMA on AMD (`dot_precision`).

8-bit caches (`KV_QUANT`, hal/common/kv_quant.py): K and V tiles load as FP8 and widen exactly to fp16
for 16-bit queries (q is clamped to the fp16 range; FP8 -> fp16 is one packed conversion where
FP8 -> bf16 takes a second, slow one per element on sm_90), to fp32 for fp32 queries. Every key's
scale is applied where it factors out of the products: QK^T column n times `k_scale[n]`, and P's
column n times `v_scale[n] / max(v_scale)` before the PV product, whose result is multiplied by the
tile's `max(v_scale)` (P stays in [0, 1] in fp16). The softmax sums stay the unscaled P's.

A step's own K/V (`OWN_KV`, `own_kv=`): where every sequence is a prompt without context, k and v
`[T, KVH, D]` of this step stand in for the cache as pages of one token, key i of a sequence being
row `query_start + i`; the block table and the sequence lengths are not read (padding rows that
start inside a block attend over their own rows too), and no tile waits on a table lookup. An 8-bit
cache's write hands them back dequantized, so its prompts take the 16-bit tile instead of widening FP8
tiles (hal/kernels/attend.py).

Pipelining: each tile's pages come from the block table one iteration ahead (`_tile_pages`), so the
K/V loads of a tile depend on no load of their own iteration and Triton's pipeliner gives them
`num_stages - 1` shared-memory buffers (with the lookup in the same iteration it gave them one,
whatever `num_stages` said: docs/performance.md, lever 22).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.kernels.configs import KernelConfig
from hal.kernels.kv_write import _key_scales
from hal.kernels.launch import Launch, launch_options, next_pow2
from hal.kernels.pdl import pdl_wait
from hal.kernels.splits import reduce_launch, split_parts, split_tiles

DECODE_MAX_QUERY_LEN = 8        # batches with <= this many new tokens per sequence use the decode config
LOG2E = 1.4426950408889634
MAX_GRID_Y = 65535              # CUDA's (and HIP's) limit on a grid's second dimension


@triton.jit
def _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence owning query block `q_block`: the last i with start[i] // BLOCK_Q + i <= q_block."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tile_pages(table_ptr, tile, last_pos, own_start, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                OWN_KV: tl.constexpr):
    """The page of every key of `tile` (0 past the sequence's last key); with `OWN_KV` the key's row
    in this step's k/v, pages of one token from the sequence's first at `own_start` (no load)."""
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if OWN_KV:
        return own_start + tl.minimum(keys, last_pos).to(tl.int64)
    return tl.load(table_ptr + keys // PAGE_SIZE, mask=keys <= last_pos, other=0).to(tl.int64)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, page, head_off,
                 scale_head, tile, row_pos, last_pos, qk_scale, stride_cb, stride_ct, stride_sb, stride_st, dims,
                 dim_valid, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr):
    """One online-softmax step over keys [tile * BLOCK_N, (tile + 1) * BLOCK_N) on pages `page` [N]."""
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)                          # [N]
    if MASKED:
        key_valid = keys <= last_pos
    key_off = page * stride_cb + (keys % PAGE_SIZE).to(tl.int64) * stride_ct + head_off   # [N]
    k_ptrs = k_cache_ptr + key_off[None, :] + dims[:, None]                 # [D, N]
    v_ptrs = v_cache_ptr + key_off[:, None] + dims[None, :]                 # [N, D]
    if MASKED:
        k = tl.load(k_ptrs, mask=dim_valid[:, None] & key_valid[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=key_valid[:, None] & dim_valid[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs, mask=dim_valid[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=dim_valid[None, :], other=0.0)
    if KV_QUANT:
        scale_off = page * stride_sb + (keys % PAGE_SIZE).to(tl.int64) * stride_st + scale_head     # [N]
        k_scale, v_scale = _key_scales(k_scale_ptr, v_scale_ptr, scale_off, keys, last_pos, MASKED)
        k = k.to(q.dtype)                   # q is float16 here unless the batch is float32
        v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * (k_scale * qk_scale)[None, :]
    else:
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale                # [M, N] log2 domain
    if MASKED:
        s = tl.where(keys[None, :] <= row_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                  # rows without keys yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_QUANT:
        v_max = tl.max(v_scale, 0)
        v_max = tl.where(v_max > 0.0, v_max, 1.0)
        pv = (p * (v_scale / v_max)[None, :]).to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PRECISION) * v_max
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# the batch's sizes and its block tables' width change every eager step, and with them whether a plane's
# table starts 16-byte aligned: specialised on them, each new class would compile a variant inside a step
# (hal/kernels/launch.py)
@triton.jit(do_not_specialize=["num_seqs", "num_tokens", "stride_bt"],
            do_not_specialize_on_alignment=["block_table_ptr"])
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, seq_lens_ptr,
        query_start_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
        qk_scale, num_seqs, num_tokens,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ct, stride_ch, stride_bt,
        stride_sb, stride_st, stride_sh,
        NUM_QUERIES_PER_KV: tl.constexpr, PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_QUANT: tl.constexpr, HEADS_FIRST: tl.constexpr,
        SKIP_SINGLE: tl.constexpr = False, OWN_KV: tl.constexpr = False, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        q_block = tl.program_id(1)
    else:
        q_block = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + seq)
    if local_block * BLOCK_Q >= q_len:
        return
    if SKIP_SINGLE and q_len == 1:        # a mixed batch's decode row: the row kernel's (attend.launches_for)
        return
    if OWN_KV:          # prompts without context: each attends over its own rows of this step's k/v
        context_len = 0
    else:
        context_len = tl.load(seq_lens_ptr + seq) - q_len  # cached tokens before this step's queries

    rows = tl.arange(0, BLOCK_M)
    row_token = local_block * BLOCK_Q + rows // NUM_QUERIES_PER_KV        # query index within the sequence
    row_head = kv_head * NUM_QUERIES_PER_KV + rows % NUM_QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * NUM_QUERIES_PER_KV) & (row_token < q_len)
    row_pos = context_len + row_token                                     # sees keys 0 .. row_pos
    token = (q_start + row_token).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q = tl.load(q_ptr + token[:, None] * stride_qt + row_head[:, None] * stride_qh + dims[None, :],
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)  # [M, D]
    if KV_QUANT and q.dtype != tl.float32:      # 16-bit queries over an 8-bit cache: float16 products
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

    first_pos = context_len + local_block * BLOCK_Q                       # the block's first token
    last_pos = context_len + tl.minimum((local_block + 1) * BLOCK_Q, q_len) - 1
    num_full = (first_pos + 1) // BLOCK_N                                 # tiles every row sees entirely
    tile_lo, tile_hi = split_tiles(tl.cdiv(last_pos + 1, BLOCK_N), split, NUM_SPLITS)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_ch
    scale_head = kv_head.to(tl.int64) * stride_sh
    # each tile's pages are loaded one iteration ahead: the K/V loads then depend on no load of their
    # own iteration, and the pipeliner gives them num_stages - 1 buffers instead of one
    page = _tile_pages(table_ptr, tile_lo, last_pos, q_start, PAGE_SIZE, BLOCK_N, OWN_KV)
    for tile in range(tile_lo, tl.minimum(tile_hi, num_full)):
        next_page = _tile_pages(table_ptr, tile + 1, last_pos, q_start, PAGE_SIZE, BLOCK_N, OWN_KV)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                     page, head_off, scale_head, tile, row_pos, last_pos, qk_scale, stride_cb,
                                     stride_ct, stride_sb, stride_st, dims, dim_valid, PAGE_SIZE, BLOCK_N, False,
                                     DOT_PRECISION, KV_QUANT)
        page = next_page
    first_masked = tl.maximum(tile_lo, num_full)
    page = _tile_pages(table_ptr, first_masked, last_pos, q_start, PAGE_SIZE, BLOCK_N, OWN_KV)
    for tile in range(first_masked, tile_hi):
        next_page = _tile_pages(table_ptr, tile + 1, last_pos, q_start, PAGE_SIZE, BLOCK_N, OWN_KV)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                     page, head_off, scale_head, tile, row_pos, last_pos, qk_scale, stride_cb,
                                     stride_ct, stride_sb, stride_st, dims, dim_valid, PAGE_SIZE, BLOCK_N, True,
                                     DOT_PRECISION, KV_QUANT)
        page = next_page

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + row_head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])
    else:
        num_heads = tl.num_programs(0 if HEADS_FIRST else 1) * NUM_QUERIES_PER_KV
        part_row = (split * num_tokens + token) * num_heads + row_head     # [M] int64
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM_PAD + dims[None, :], acc,
                 mask=row_valid[:, None])
        tl.store(part_max_ptr + part_row, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_valid)


def dot_precision(dtype: torch.dtype, target: str) -> str:
    """fp32 attention: 3xTF32 tensor-core products on NVIDIA (fp32-level error; plain "ieee" would
    fall back to FMA and spill), native fp32 MFMA on AMD, exact products in the interpreter."""
    return "tf32x3" if dtype == torch.float32 and target == "cuda" else "ieee"


def config_key(kind: str, dtype: torch.dtype, is_quantized: bool = False) -> str:
    """Table key of the attention config: "attention_prefill", "attention_decode_fp32", ...;
    16-bit attention over an 8-bit cache has its own ("attention_prefill_fp8": the FP8 -> bf16
    widening of K/V tiles costs registers the largest AMD tiles do not have; "attention_decode_fp8":
    see hal/kernels/configs.py)."""
    if dtype == torch.float32:
        return f"attention_{kind}_fp32"
    return f"attention_{kind}" + ("_fp8" if is_quantized else "")


def attention_launches(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                       config: KernelConfig, num_splits: int, reduce_config: KernelConfig,
                       out: torch.Tensor, target: str, kv_scales: torch.Tensor | None = None,
                       skip_single: bool = False, own_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> list[Launch]:
    """The launches of one attention call for `target` ("cuda", "hip", "interpreter"); `out`
    `[T, H, D]` receives the result. `config.heads_first`: grid `(KVH, query blocks, splits)`, the KV
    heads of a query block side by side (they read the same cache rows), where the query blocks fit
    the grid's second dimension. `skip_single`: sequences of one query token are left to another
    launch (the row kernel's, in a mixed batch) and their rows of `out` untouched.

    q `[T, H, D]`; kv_cache `[2, NB, page, KVH, D]`; block_table `[S, max_blocks]` int32 (one plane);
    seq_lens `[S]` int32 (cached tokens incl. this step's); query_start_loc `[S + 1]` int32.
    kv_scales `[2, NB, page, KVH]` exponent bytes for an 8-bit kv_cache (`hal.common.kv_quant.QuantLayout.scales`,
    any strides).
    `own_kv`: (k, v) `[T, KVH, D]` of q's dtype with the same strides, this step's K/V: every sequence is
    a prompt without context and attends over its own rows of them, not over the cache (which the
    launch then never reads: kv_cache gives only its head count, block_table and seq_lens are unread).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, page_size, num_kv_heads, _ = kv_cache.shape
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    if own_kv is not None:
        k, v = own_kv
        if kv_scales is not None or k.dtype != q.dtype or k.shape != (num_tokens, num_kv_heads, head_dim) \
                or v.shape != k.shape or v.stride() != k.stride() or k.stride(-1) != 1:
            raise ValueError("own_kv takes k and v [T, KVH, D] of q's dtype with one set of strides "
                             "(unit along D), and no scales")
        key_cache, value_cache, page_size = k[:, None], v[:, None], 1      # one-token pages [T, 1, KVH, D]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    block_m = max(config.block_m, next_pow2(group), 16)          # tl.dot needs >= 16 rows
    block_q = block_m // group
    head_dim_pad = max(next_pow2(head_dim), 16)
    # unquantized: the scale pointers are never read (KV_QUANT is a constexpr); any pointer will do
    k_scales, v_scales = (key_cache, value_cache) if kv_scales is None else (kv_scales[0], kv_scales[1])
    scale_strides = (0, 0, 0) if kv_scales is None else kv_scales.stride()[1:]
    parts = split_parts(q, num_splits, head_dim_pad)
    num_q_blocks = num_tokens // block_q + num_seqs
    heads_first = bool(config.heads_first) and num_q_blocks <= MAX_GRID_Y
    grid = (num_kv_heads, num_q_blocks, num_splits) if heads_first else (num_q_blocks, num_kv_heads, num_splits)
    main = Launch(_paged_attention_kernel, grid, (
        out, q, key_cache, value_cache, k_scales, v_scales, block_table, seq_lens, query_start_loc, *parts,
        scale * LOG2E, num_seqs, num_tokens, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_table.stride(0),
        *scale_strides), dict(
        NUM_QUERIES_PER_KV=group, PAGE_SIZE=page_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=config.block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=dot_precision(q.dtype, target), KV_QUANT=kv_scales is not None, HEADS_FIRST=heads_first,
        SKIP_SINGLE=skip_single, OWN_KV=own_kv is not None, **launch_options(config, target)))
    if num_splits == 1:
        return [main]
    return [main, reduce_launch(out, parts, reduce_config, target)]
