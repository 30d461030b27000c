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
- steps with prefill: the op takes no paged antiquant for Q_S > 1, so the blocks of this step's tables
  are dequantized (on the device, no host sync) into a scratch cache in the model dtype and the usual
  TND call runs over it with a table numbering the gathered blocks. Costs one extra read and write of
  those blocks per layer; prefill is compute-bound.
`fia_pa` takes the same paths (ATB paged attention is not used for int8 caches).
"""
from __future__ import annotations

from typing import Any

import torch

from hal.ascend.attention import AscendMeta, FusedAttention
from hal.common.kv_quant import QuantLayout, dequantize, quantize

SITE = "fused_infer_attention_int8"


class Int8FusedAttention(FusedAttention):
    """`FusedAttention` over an int8 cache with per-(token, head) scales (see the module docs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kv_dtype = torch.int8
        self.kv_layout = QuantLayout(self.num_kv_heads, self.head_dim, self.block_size, torch.int8,
                                     heads_outer=False)
        self.name += "+int8"

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.kv_layout.cache_shape(num_blocks)

    # ----- views of the byte cache (read_kv, copy_kv and block_views: the base class's, by kv_layout)
    def values(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, block_size, KVH * D]` int8."""
        return self.kv_layout.values(kv_cache).flatten(-2)

    def scales(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, KVH, block_size]` float32."""
        return self.kv_layout.head_scales(kv_cache)

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
        if meta.is_decode:
            out = self.ops.fused_infer_attention_int8(
                query, values[0], values[1], key_scales=scales[0], value_scales=scales[1],
                block_table=meta.block_tables[plane], kv_lens=meta.kv_lens[plane], num_heads=self.num_heads,
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
            return {"actual_seq_lengths_kv": list(meta.kv_lens[plane])}
        return super()._host_params(meta, site, plane)
