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
- passes of at most `ROW_QUERIES` queries per sequence (speculation's verify passes, short chunks):
  the op takes no paged antiquant for Q_S > 1, so each query row is a sequence of its own in the same
  BSH call, with its sequence's table row and its causal KV length (`_row_kv_lens`). Each row reads
  its prefix's int8 bytes once; no cache is dequantized.
- longer prefills: the blocks of this step's tables are dequantized (on the device, no host sync)
  into a scratch cache in the model dtype and the usual TND call runs over it with a table numbering
  the gathered blocks. Costs one extra read and write of those blocks per layer; prefill is
  compute-bound. A captured pass dequantizes every block its tables have room for, so a prompt's only
  chunk is captured with tables of its own width (`runtime.execution.graphs.PassGraphs.max_blocks_of`),
  and a later chunk wider than `ROW_QUERIES` runs eagerly (`AttnCaps.max_context_prefill_width`):
  captured, its tables would have room for max_model_len.
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
# Most queries per sequence attended row by row: a verify pass (k + 1 tokens) or a short chunk reads its
# prefix once per row, where the dequantizing path writes and reads every block its tables name in the
# model dtype (about 5 bytes per cached element against 1 per row here), max_model_len's worth in a
# captured pass with context
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
        lens = [int(q) for q in batch.query_lens]
        if not meta.is_decode and lens and max(lens) <= ROW_QUERIES:
            meta.row_seqs = self._rows(np.repeat(np.arange(len(lens)), lens))
        return meta

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


def _row_kv_lens(meta: AscendMeta, plane: int) -> list[int]:
    """The causal KV length of each query row `[T]` of plane `plane`: a sequence's j-th of n queries
    sees its first `kv_len - n + 1 + j` tokens (a decode step's rows: the sequences' KV lengths)."""
    starts = [0, *meta.cum_query_lens]
    return [kv - (end - start) + 1 + j for kv, start, end in zip(meta.kv_lens[plane], starts, starts[1:])
            for j in range(end - start)]
