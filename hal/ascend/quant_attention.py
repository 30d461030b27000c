"""Int8 KV cache on Ascend (the 910B has no FP8): what `hal.attention(..., kv_dtype=torch.int8)` builds
for the fused backends.

Quantization as everywhere (hal/common/kv_quant.py): one float32 scale per (token, KV head), `absmax / 127`,
fixed when the token is written. Layout: `hal.common.kv_quant.QuantLayout` slot-major
(`heads_outer=False`), which the fused op's paged antiquant takes (mode 5, "per-token + per-head,
scales managed by page attention"): per half (K, V)
    values `[num_blocks, block_size, KVH * D]` int8 (BnBsH, what the op and the KV scatter take), then
    scales `[num_blocks, KVH, block_size]` float32 (what mode 5 takes).
- decode-only steps: `npu_fused_infer_attention_score` in BSH (one query per sequence) with
  key/value_antiquant_scale and key/value_antiquant_mode=5; graph-capturable, updated like the bf16
  call (the KV lengths).
- passes with more queries per sequence (speculation's verify passes, prompt chunks): the op takes no
  paged antiquant for Q_S > 1. Either each query row becomes a sequence of its own in the same BSH
  call, with its sequence's table row and its causal KV length (`_row_kv_lens`): each row reads its
  prefix's int8 bytes; or the blocks of the step's tables are dequantized (on the device, no host
  sync) into a scratch cache in the model dtype and the usual TND call runs over it with a table
  numbering the gathered blocks: about 5 bytes per cached element the tables name (read int8, write
  and read bf16). `_attends_by_rows` picks the fewer bytes: an eager step by its lengths (a prompt
  without context dequantizes; decodes beside a chunk go by rows); a captured pass by its capacity:
  by rows where its tables have room for max_model_len (`MetaCapacity.context`: verify passes,
  short chunks), dequantizing where they are a prompt's own (its only chunk). A later chunk wider
  than `ROW_QUERIES` runs eagerly (`AttnCaps.max_context_prefill_width`) rather than be captured.
`fia_pa` takes the same paths (ATB paged attention is not used for int8 caches).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hal.ascend.attention import AscendMeta, FusedAttention
from hal.attention import AttnCaps, MetaCapacity, PagedBatch
from hal.common.kv_quant import QuantLayout, dequantize, quantize

SITE = "fused_infer_attention_int8"
DEQUANT_BYTES = 5   # per cached element a dequantizing pass names: int8 read, bf16 written and read back
# Widest prompt chunk with context that is captured (its graph attends by rows, each of its rows reading
# up to max_model_len's bytes, against dequantizing all that room); wider ones run eagerly, over tables
# of their own length
ROW_QUERIES = 16


class Int8FusedAttention(FusedAttention):
    """`FusedAttention` over an int8 cache with per-(token, head) scales (see the module docs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kv_dtype = torch.int8
        self.kv_layout = QuantLayout(self.num_kv_heads, self.head_dim, self.block_size, torch.int8,
                                     heads_outer=False)
        self.name += "+int8"

    @property
    def caps(self) -> AttnCaps:
        return super().caps._replace(max_context_prefill_width=ROW_QUERIES)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.kv_layout.cache_shape(num_blocks)

    # ----- views of the byte cache (read_kv, copy_kv and block_views: the base class's, by kv_layout)
    def values(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, block_size, KVH * D]` int8."""
        return self.kv_layout.values(kv_cache).flatten(-2)

    def scales(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, KVH, block_size]` float32."""
        return self.kv_layout.head_scales(kv_cache)

    def build_meta(self, batch: PagedBatch, capacity: MetaCapacity | None = None) -> AscendMeta:
        """The base meta, plus each query row's sequence where the pass attends row by row (fixed
        with the query lengths, so `update_meta` keeps it)."""
        meta = super().build_meta(batch, capacity)
        lens = np.asarray(batch.query_lens, dtype=np.int64)
        if not meta.is_decode and lens.size and _attends_by_rows(batch, meta, capacity):
            meta.row_seqs = self._rows(np.repeat(np.arange(lens.size), lens))
        return meta

    def update_meta(self, meta: AscendMeta, batch: PagedBatch) -> list[dict[str, Any]]:
        meta.row_kv_lens.clear()                  # new lengths: the rows' are computed again
        return super().update_meta(meta, batch)

    # ----- KV write and attention -----------------------------------------------------------
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AscendMeta,
                 plane: int) -> None:
        slots, rows = meta.slot_mapping[plane], meta.write_rows[plane]
        if rows is not None:            # the kernel takes no -1 slots: drop the rows without one
            k, v, slots = k.index_select(0, rows), v.index_select(0, rows), slots.index_select(0, rows)
        if not slots.shape[0]:
            return
        (qk, k_scale), (qv, v_scale) = quantize(k, torch.int8), quantize(v, torch.int8)   # [T, KVH, D], [T, KVH]
        values = self.values(kv_cache).unflatten(-1, (self.num_kv_heads, self.head_dim))
        self.ops.scatter_kv(qk.contiguous(), qv.contiguous(), values[0], values[1], slots)
        scales, at = self.scales(kv_cache), self.kv_layout.slot_index(slots)
        scales[0][at] = k_scale
        scales[1][at] = v_scale

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AscendMeta, plane: int,
                scale: float) -> torch.Tensor:
        query = q.to(self.dtype).contiguous()                                        # [T, H, D]
        values, scales = self.values(kv_cache), self.scales(kv_cache)
        if meta.is_decode or meta.row_seqs is not None:
            table = meta.block_tables[plane]                                         # [S, max_blocks]
            if meta.row_seqs is not None:
                table = table.index_select(0, meta.row_seqs)                         # [T, max_blocks]
            out = self.ops.fused_infer_attention_int8(
                query, values[0], values[1], key_scales=scales[0], value_scales=scales[1],
                block_table=table, kv_lens=_row_kv_lens(meta, plane), num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, scale=scale, block_size=self.block_size)
            if self.ops.capturing:
                self._note_capture(meta, SITE, plane)
        else:
            table = meta.block_tables[plane]                                         # [S, max_blocks]
            gathered = table.flatten().long()
            key, value = (self._dequantize_blocks(values[i], scales[i], gathered) for i in (0, 1))
            renumbered = torch.arange(gathered.shape[0], dtype=torch.int32,
                                      device=table.device).view(table.shape)
            out = self.ops.fused_infer_attention(
                query, key, value, atten_mask=self.mask, block_table=renumbered,
                cum_query_lens=meta.cum_query_lens, kv_lens=meta.kv_lens[plane], num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, scale=scale, block_size=self.block_size)
            if self.ops.capturing:
                self._note_capture(meta, "fused_infer_attention", plane)
        rows = meta.unused_rows[plane]
        if rows is not None:
            out = out.index_fill(0, rows, 0)
        return out.to(q.dtype)

    def _dequantize_blocks(self, values: torch.Tensor, scales: torch.Tensor,
                           blocks: torch.Tensor) -> torch.Tensor:
        """Blocks `blocks: [N]` of one half as `[N, block_size, KVH * D]` in the model dtype (contiguous)."""
        rows = values[blocks].unflatten(-1, (self.num_kv_heads, self.head_dim))        # [N, bs, KVH, D]
        out = dequantize(rows, scales[blocks].transpose(1, 2), self.dtype)            # scales [N, bs, KVH]
        return out.flatten(-2).contiguous()

    def _host_params(self, meta: AscendMeta, site: str, plane: int) -> dict[str, Any]:
        if site == SITE:
            return {"actual_seq_lengths_kv": _row_kv_lens(meta, plane)}
        return super()._host_params(meta, site, plane)


def _attends_by_rows(batch: PagedBatch, meta: AscendMeta, capacity: MetaCapacity | None) -> bool:
    """Whether a pass with more than one query for some sequence attends row by row (module docs):
    captured, where its tables have room for context; eager, where its rows read fewer bytes than
    dequantizing its tables would move."""
    if capacity is not None:
        return capacity.context
    query_lens, seq_lens = (np.asarray(x, dtype=np.int64) for x in (batch.query_lens, batch.seq_lens))
    num_seqs, width = meta.block_tables.shape[1:]
    return int(query_lens @ seq_lens) <= DEQUANT_BYTES * num_seqs * width * batch.block_size


def _row_kv_lens(meta: AscendMeta, plane: int) -> list[int]:
    """The causal KV length of each query row `[T]` of plane `plane`: a sequence's j-th of n queries
    sees its first `kv_len - n + 1 + j` tokens (a decode step's rows: the sequences' KV lengths).
    Computed once per plane and step (every layer of the plane asks)."""
    if meta.row_seqs is None:
        return list(meta.kv_lens[plane])
    lens = meta.row_kv_lens.get(plane)
    if lens is None:
        starts = np.asarray([0, *meta.cum_query_lens], dtype=np.int64)
        counts = np.diff(starts)
        first = np.asarray(meta.kv_lens[plane], dtype=np.int64) - counts + 1 - starts[:-1]   # per sequence
        lens = meta.row_kv_lens[plane] = (np.repeat(first, counts) + np.arange(starts[-1])).tolist()
    return lens
