"""Which paged-attention kernel a batch takes, in which config and with how many context splits.

- Multi-head decode (one new token per sequence, one query head per KV head, 16-bit queries) takes
  the row-stream kernel (hal/kernels/row_decode.py) where the arch's table has a config for it
  (`attention_row_decode`, `attention_row_decode_fp8`; a context split 16 ways takes
  `attention_row_decode_split` / `attention_row_decode_split_fp8` where the table has it, one split
  2-15 ways `attention_row_decode_split_few(_fp8)`, a batch of many programs per compute unit
  `attention_row_decode_dense(_fp8)`);
  grouped-query decode takes it only where even one program per query head leaves the context split
  (a few sequences: `row_decode_key`);
- grouped-query decode past those few sequences takes the TMA kernel (hal/kernels/gqa_decode.py)
  where the table has `attention_decode_tma_fp8` (FP8 cache) / `attention_decode_tma` (16-bit) and
  the cache fits it;
- every other batch takes the unified kernel (hal/kernels/attention.py): its decode config for
  batches of at most `DECODE_MAX_QUERY_LEN` new tokens per sequence, its prefill config otherwise;
- prompts without context (`own_kv`) take the 16-bit prefill config over this step's own K/V, as pages
  of one token with no block-table lookups; over an 8-bit cache those K/V are what its write handed
  back dequantized, where FP8 tiles widened in the kernel cost it 1.5x the 16-bit tile's time
  (docs/performance.md, levers 130, 135 and 136);
- a mixed batch (prompt chunks beside sequences of one new token: requests joining a decoding
  batch, a burst's packed steps) of a multi-head model splits where the table has the row kernel:
  the prefill config takes the chunks, the row kernel (its `attention_row_decode` entry, the
  context unsplit) the one-token rows, which in the prefill config ran one real query row in a
  tensor-core tile of 64 (docs/performance.md, lever 113). The split depends on the batch's kind
  alone, never on its sizes, so an eager step and a captured packed pass give the same bits.
Decode-like batches split the context (hal/kernels/splits.py). Every choice depends on host integers
fixed per graph bucket (`max_query_len`, the number of sequences, dtypes, compute units), never on a
device value.
"""
from __future__ import annotations

import torch

from hal.kernels.attention import DECODE_MAX_QUERY_LEN, attention_launches, config_key
from hal.kernels.configs import KernelConfig
from hal.kernels.gqa_decode import fits as gqa_decode_fits, gqa_decode_launches
from hal.kernels.launch import Launch, backend_of, check_device, run_launch
from hal.kernels.row_decode import NewKV, row_decode_launches
from hal.kernels.splits import num_kv_splits

GQA_TMA_KEY = "attention_decode_tma"             # grouped-query decode on TMA page copies (sm_90; + "_fp8")
SPLIT_ROW_KEY = "attention_row_decode_split"     # the row kernel's config where the context splits (+ "_fp8")
# ... into at least this many parts. H200, batch 1, 8 keys x 2 warps x 2 stages against the row entry's
# 16 x 2 x 3 (2026-12-03): Ouro-1.4B (16 splits) 4.415 -> 4.352 ms; Huginn-0125 (8 splits of 55
# heads) 30.71 -> 30.89 and Nanbeige4.2-3B (8 splits of 48 query heads) 4.519 -> 4.540, slower
SPLIT_ROW_MIN_SPLITS = 16
# ... into 2 to SPLIT_ROW_MIN_SPLITS - 1 parts (+ "_fp8"): those 8-split batch-1 steps, whose best tiles
# differ again (8 keys x 2 warps x 3 stages; FP8 8 x 1 x 3: hal/kernels/configs.py, 2026-12-04)
FEW_SPLITS_ROW_KEY = "attention_row_decode_split_few"
DENSE_ROW_KEY = "attention_row_decode_dense"     # the row kernel's config where programs crowd the SMs (+ "_fp8")
# ... at least this many (sequence, head) programs per compute unit. H200, FP8 at 128 x 1K (15.5 per SM),
# head-major values: 8 keys x 1 warp x 3 stages 137.3 us per layer-plane against 138.5 for the whole-batch
# entry's 16 x 1 x 3, engine step 19.24 -> 19.03 ms; at 64 x 1K (7.75 per SM) 78.1 against 72.5
# (2026-12-03, eighteenth session, lever 74)
DENSE_ROW_MIN_PROGRAMS = 12


def row_decode_key(dtype: torch.dtype, num_heads: int, num_kv_heads: int, max_query_len: int,
                   is_quantized: bool, num_seqs: int, num_compute_units: int) -> str | None:
    """The table key of the row-stream kernel's config where the batch fits it, else None.

    Grouped queries fit it only where one program per (sequence, query head) still leaves the
    context split: there the attention is a few short dependent tiles per program, and the row
    kernel's shorter chain (and its rotary + KV store, `fuses_rotary`) beats the unified kernel's
    tensor-core tile of 16 rows holding a group of a few; with more sequences the unified kernel,
    reading each KV head once per group, keeps them."""
    if max_query_len != 1 or dtype == torch.float32 or num_heads % num_kv_heads:
        return None
    if num_heads != num_kv_heads and num_row_splits(num_seqs, num_heads, num_compute_units) == 1:
        return None
    return "attention_row_decode" + ("_fp8" if is_quantized else "")


def num_row_splits(num_seqs: int, num_heads: int, num_compute_units: int) -> int:
    """Context splits of the row kernel, whose programs are (sequence, query head) pairs."""
    return num_kv_splits(num_seqs, num_heads, num_compute_units)


def fuses_rotary(dtype: torch.dtype, num_heads: int, num_kv_heads: int, max_query_len: int, is_quantized: bool,
                 configs: dict[str, KernelConfig], num_seqs: int, num_compute_units: int) -> bool:
    """Whether the row kernel should rotate and store this step's K/V itself (`paged_attention(new_kv=)`):
    where it takes the batch and splits the context, i.e. small decode batches. There the attention
    is a chain of short dependent launches and one launch fewer per layer-plane pays (H200, Ouro-1.4B
    batch 1: 4.658 -> 4.604 ms); unsplit, every program would pay the rotation and the store before
    its first key, and the 128 x 1K FP8 step went 22.71 -> 23.01 ms (docs/performance.md, lever 58)."""
    return (row_decode_key(dtype, num_heads, num_kv_heads, max_query_len, is_quantized, num_seqs,
                           num_compute_units) in configs
            and num_row_splits(num_seqs, num_heads, num_compute_units) > 1)


def launches_for(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                 configs: dict[str, KernelConfig], num_compute_units: int, out: torch.Tensor,
                 kv_scales: torch.Tensor | None = None, new_kv: NewKV | None = None,
                 mixed: bool = False, own_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> list[Launch]:
    """The launches `paged_attention` runs for this batch (`mixed`: it may hold one-token sequences
    beside its prompt chunks; `own_kv`: see `paged_attention`)."""
    if own_kv is not None:
        if max_query_len <= DECODE_MAX_QUERY_LEN or mixed:
            raise ValueError("own_kv serves prompts without context in the prefill config, not decode-like "
                             "or mixed batches")
        # K/V in q's dtype (an 8-bit cache's dequantized by its write): that dtype's prefill tile
        return attention_launches(q, kv_cache, block_table, seq_lens, query_start_loc, scale,
                                  configs[config_key("prefill", q.dtype)], 1, configs["attention_reduce"],
                                  out, backend_of(q.device), own_kv=own_kv)
    quantized = kv_scales is not None
    num_kv_heads = kv_cache.shape[3]
    args = (q, kv_cache, block_table, seq_lens, query_start_loc, scale)
    num_seqs = seq_lens.shape[0]
    row_key = row_decode_key(q.dtype, q.shape[1], num_kv_heads, max_query_len, quantized, num_seqs,
                             num_compute_units)
    if new_kv is not None and row_key not in configs:
        raise ValueError("only the row-stream decode kernel rotates and stores this step's K/V itself "
                         "(check attend.fuses_rotary first)")
    if max_query_len > DECODE_MAX_QUERY_LEN:
        single_key = row_decode_key(q.dtype, q.shape[1], num_kv_heads, 1, quantized, num_seqs, num_compute_units)
        split = mixed and q.shape[1] == num_kv_heads and single_key in configs
        launches = attention_launches(*args, configs[config_key("prefill", q.dtype, quantized)], 1,
                                      configs["attention_reduce"], out, backend_of(q.device), kv_scales,
                                      skip_single=split)
        if split:
            # unsplit: a fixed 4-way split (with a reduce of one-token sequences) measured level on an
            # H100, the row launch waiting for the chunks' launch before it either way (lever 113)
            launches += row_decode_launches(*args, configs[single_key], 1, configs["attention_reduce"], out,
                                            backend_of(q.device), kv_scales)
        return launches
    reduce_config, target = configs["attention_reduce"], backend_of(q.device)
    if row_key in configs:
        num_splits = num_row_splits(num_seqs, q.shape[1], num_compute_units)
        suffix = "_fp8" if quantized else ""
        if num_splits >= SPLIT_ROW_MIN_SPLITS:
            config = configs.get(SPLIT_ROW_KEY + suffix)
        elif num_splits > 1:
            config = configs.get(FEW_SPLITS_ROW_KEY + suffix)
        elif num_seqs * q.shape[1] >= DENSE_ROW_MIN_PROGRAMS * num_compute_units:
            config = configs.get(DENSE_ROW_KEY + suffix)
        else:
            config = None
        return row_decode_launches(*args, config or configs[row_key], num_splits, reduce_config, out, target,
                                   kv_scales, new_kv)
    tma_key = GQA_TMA_KEY + ("_fp8" if quantized else "")
    if tma_key in configs and gqa_decode_fits(q, kv_cache, kv_scales, max_query_len):
        return gqa_decode_launches(q, kv_cache, kv_scales, block_table, seq_lens, query_start_loc, scale,
                                   configs[tma_key], reduce_config, out, target, num_compute_units)
    num_splits = num_kv_splits(num_seqs, num_kv_heads, num_compute_units)
    return attention_launches(*args, configs[config_key("decode", q.dtype, quantized)], num_splits, reduce_config,
                              out, target, kv_scales)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                    configs: dict[str, KernelConfig], num_compute_units: int,
                    kv_scales: torch.Tensor | None = None, new_kv: NewKV | None = None,
                    mixed: bool = False, own_kv: tuple[torch.Tensor, torch.Tensor] | None = None
                    ) -> torch.Tensor:
    """Causal attention of packed queries over one plane of the paged cache; returns `[T, H, D]`.

    q `[T, H, D]`; kv_cache `[2, NB, page, KVH, D]`; block_table `[S, max_blocks]` int32 (one plane);
    seq_lens `[S]` int32 (cached tokens incl. this step's); query_start_loc `[S + 1]` int32;
    kv_scales `[2, NB, page, KVH]` exponent bytes for an 8-bit kv_cache (`hal.common.kv_quant.QuantLayout.scales`);
    `new_kv` (row kernel only): q and this step's k, v before rotary, stored by the kernel itself;
    `mixed`: prompt chunks and one-token sequences may share the batch (`launches_for`);
    `own_kv`: (k, v) `[T, KVH, D]` in q's dtype, this step's K/V, where every sequence is a prompt without
    context: each attends over its own rows of them in that dtype's prefill tile instead of reading the
    cache back (an 8-bit cache's K/V as its write hands them back dequantized: levers 135-136).
    """
    check_device(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_table.stride(-1) != 1 or seq_lens.stride(0) != 1 or query_start_loc.stride(0) != 1:
        raise ValueError("attention metadata must be contiguous along its last dim (build_meta makes it so)")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    for launch in launches_for(q, kv_cache, block_table, seq_lens, query_start_loc, max_query_len, scale,
                               configs, num_compute_units, out, kv_scales, new_kv, mixed, own_kv):
        run_launch(launch)
    return out
