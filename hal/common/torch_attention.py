"""Reference paged attention in plain torch: the backend every vendor's kernels are checked against.

One layer's cache is `[2, num_blocks, block_size, KVH, D]` (K then V). Every sequence gathers its
blocks and runs dense attention with a bottom-right causal mask; clear rather than fast.
With an 8-bit `kv_dtype` the cache is `hal.common.kv_quant.QuantLayout`'s bytes: writes quantize (FP8 emulated with
torch's float8 dtypes, which work on the CPU), attention dequantizes to float32 and runs as above.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hal.attention import AttentionBackend, AttnCaps, MetaCapacity, PagedBatch, dense_attention
from hal.common.paged import block_table_array, query_start_loc, slot_mapping, table_lengths


@dataclass
class CpuMeta:
    query_start: list[int]          # [S + 1] cumulative query offsets
    seq_lens: list[int]             # [S] tokens in the cache per sequence, this step's included
    num_blocks: list[list[int]]     # [P][S] how many blocks each sequence has in each plane
    block_tables: torch.Tensor      # [P, S, max_blocks] int64
    slot_mapping: torch.Tensor      # [P, T] int64, -1 = do not write


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    @property
    def caps(self) -> AttnCaps:
        return AttnCaps(packed_prefill=True, graphs=True, packed_graphs=True,
                        reason="reference paged attention in plain torch (graphs replay eagerly)")

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.kv_layout is not None:
            return self.kv_layout.cache_shape(num_blocks)
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def build_meta(self, batch: PagedBatch, capacity: MetaCapacity | None = None) -> CpuMeta:
        return CpuMeta(
            query_start=query_start_loc(batch).tolist(),
            seq_lens=list(batch.seq_lens),
            num_blocks=table_lengths(batch).tolist(),
            block_tables=torch.from_numpy(block_table_array(batch)).to(self.device, torch.int64),
            slot_mapping=torch.from_numpy(slot_mapping(batch)).to(self.device),
        )

    def update_meta(self, meta: CpuMeta, batch: PagedBatch) -> list[dict[str, Any]]:
        # eager replays read the fields at call time, so replacing them in place is enough
        fresh = self.build_meta(batch)
        meta.__dict__.update(fresh.__dict__)
        return []

    def advance_meta(self, meta: CpuMeta, steps: int) -> CpuMeta | None:
        """Host lengths advanced and slots read from the tables: for eager replays (the CPU) only;
        elsewhere (a device graph) the lengths would be baked at capture."""
        if meta.block_tables.device.type != "cpu":
            return None
        if any(b - a != 1 for a, b in zip(meta.query_start, meta.query_start[1:])):
            raise ValueError("advance_meta takes decode metadata (one query token per sequence)")
        seq_lens = [n + steps for n in meta.seq_lens]
        positions = torch.tensor(seq_lens, dtype=torch.long, device=meta.block_tables.device) - 1         # [S]
        index = positions // self.block_size
        lengths = torch.tensor(meta.num_blocks, dtype=torch.long, device=positions.device).reshape(
            len(meta.num_blocks), len(seq_lens))                                                         # [P, S]
        tables = meta.block_tables
        blocks = tables.gather(2, index.clamp(max=max(tables.shape[-1] - 1, 0))[None, :, None].expand(
            tables.shape[0], -1, 1))[..., 0]
        slots = torch.where(index[None] < lengths, blocks * self.block_size + positions % self.block_size, -1)
        return CpuMeta(meta.query_start, seq_lens, meta.num_blocks, tables, slots)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: CpuMeta,
                 plane: int) -> None:
        slots = meta.slot_mapping[plane]
        keep = slots >= 0
        if not bool(keep.all()):
            slots, k, v = slots[keep], k[keep], v[keep]
        if self.kv_layout is not None:
            self.kv_layout.write(kv_cache, 0, slots, k)
            self.kv_layout.write(kv_cache, 1, slots, v)
            return
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)
        flat[0].index_copy_(0, slots, k.to(flat.dtype))
        flat[1].index_copy_(0, slots, v.to(flat.dtype))

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: CpuMeta, plane: int,
                scale: float) -> torch.Tensor:
        out = torch.zeros_like(q)
        key_cache, value_cache = kv_cache[0], kv_cache[1]               # (unquantized caches)
        compute = torch.promote_types(q.dtype, torch.float32)       # low precision in, float32 math
        for i, seq_len in enumerate(meta.seq_lens):
            lo, hi = meta.query_start[i], meta.query_start[i + 1]
            num_blocks = meta.num_blocks[plane][i]
            if hi == lo or num_blocks == 0:
                continue
            blocks = meta.block_tables[plane, i, :num_blocks]
            if self.kv_layout is not None:
                k = self.kv_layout.read_blocks(kv_cache, 0, blocks).flatten(0, 1)[:seq_len]
                v = self.kv_layout.read_blocks(kv_cache, 1, blocks).flatten(0, 1)[:seq_len]
            else:
                k = key_cache[blocks].flatten(0, 1)[:seq_len]          # [L, KVH, D]
                v = value_cache[blocks].flatten(0, 1)[:seq_len]
            qi = q[lo:hi].transpose(0, 1)[None]                     # [1, H, Q, D]
            o = dense_attention(qi.to(compute), k.transpose(0, 1)[None].to(compute),
                                v.transpose(0, 1)[None].to(compute), scale=scale, causal=True)
            out[lo:hi] = o[0].transpose(0, 1).to(q.dtype)
        return out
