"""Paged attention on Ascend: `npu_fused_infer_attention_score` in TND layout over a block-128 cache.

Cache of one layer: `[2, num_blocks, block_size, KVH, D]` (K then V), the layout vllm-ascend uses;
the fused op sees each half as BnBsH `[num_blocks, block_size, KVH * D]`, the KV write sees it
as `[num_blocks, block_size, KVH, D]`. Lengths travel as host lists (cumulative query lengths,
per-sequence KV lengths), so a captured graph bakes them in: each meta remembers the updatable
calls captured with it, and `update_meta(meta, batch)` returns their new host arguments, which
`Graph.update` takes. Backend "fia_pa" sends decode-only steps to ATB `_npu_paged_attention`.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hal.ascend.ops import MASK_SIZE, AscendOps
from hal.attention import AttentionBackend, AttnCaps, MetaCapacity, PagedBatch
from hal.common.torch_attention import TorchPagedAttention
from hal.common.paged import block_table_array, slot_mapping, table_lengths


@dataclass
class AscendMeta:
    """One step's attention metadata, shared by every loop and layer (P planes, S sequences, T tokens)."""

    cum_query_lens: list[int]                   # [S] actual_seq_lengths: cumulative query lengths
    kv_lens: list[list[int]]                    # [P][S] actual_seq_lengths_kv per plane
    context_lens: list[torch.Tensor]            # [P] host int32 [S]: kv_lens for _npu_paged_attention
    block_tables: torch.Tensor                  # [P, S, max_blocks] int32, on the device
    slot_mapping: torch.Tensor                  # [P, T] int32 on the device, -1 where a plane is unused
    write_rows: list[torch.Tensor | None]       # [P] token rows with a slot (None = all of them)
    unused_rows: list[torch.Tensor | None]      # [P] query rows of sequences without KV there (output 0)
    is_decode: bool                             # every sequence has exactly one query
    # [T] int64 on the device: each query row's sequence, where a backend attends row by row
    # (int8 passes of a few queries per sequence: quant_attention.py); fixed with the query lengths
    row_seqs: torch.Tensor | None = None
    row_kv_lens: dict[int, list[int]] = field(default_factory=dict)    # per plane: each row's, this step's
    # the updatable calls (site, plane) captured with this meta, in capture order, and the capture
    # they belong to: what update_meta returns host arguments for
    graph_calls: list[tuple[str, int]] = field(default_factory=list)
    captured_in: Any = None


class FusedAttention(AttentionBackend):
    """`fia`: fused infer attention for every step; `fia_pa`: ATB paged attention for decode-only steps."""

    name = "fia"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int, ops: AscendOps, paged_decode: bool = False,
                 reason: str = "") -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, dtype, device, block_size)
        self.ops, self.paged_decode, self.reason = ops, paged_decode, reason
        self.name = "fia_pa" if paged_decode else "fia"
        # sparse_mode 3 takes this fixed mask: True (masked) strictly above the diagonal; a normal
        # tensor even when the engine is built under inference_mode (a TP follower's is)
        with torch.inference_mode(False):
            self.mask = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device).triu_(1)

    @property
    def caps(self) -> AttnCaps:
        return AttnCaps(packed_prefill=True, graphs=True, reason=self.reason)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    # ----- metadata ---------------------------------------------------------------------------
    def build_meta(self, batch: PagedBatch, capacity: MetaCapacity | None = None) -> AscendMeta:
        """With `capacity` the block tables are `max_blocks_per_seq` wide, so a graph captured on this
        meta takes every later batch of the same sequence count and query lengths (`update_meta`)."""
        if capacity is None:
            return self._build(batch)
        problems = [f"{what} {got} > capacity {cap}" for what, got, cap in (
            ("sequences", len(batch.query_lens), capacity.max_num_seqs),
            ("tokens", sum(batch.query_lens), capacity.max_num_tokens),
            ("planes", len(batch.block_tables), capacity.num_planes),
            ("sequence length", max(batch.seq_lens, default=0), capacity.max_seq_len)) if got > cap]
        if problems:
            raise ValueError(f"batch exceeds the meta capacity: {'; '.join(problems)}")
        return self._build(batch, capacity.max_blocks_per_seq, check_slots=True)

    def _build(self, batch: PagedBatch, max_blocks: int = 0, check_slots: bool = False) -> AscendMeta:
        """The meta of `batch`, block tables at least `max_blocks` wide; `check_slots` refuses repeated
        KV slots (graph steps, whose padding rows are the runtime's; eager steps skip the cost)."""
        if batch.block_size != self.block_size:
            raise ValueError(f"batch block_size {batch.block_size} != backend block_size {self.block_size}")
        bs, query_lens, seq_lens = self.block_size, [int(q) for q in batch.query_lens], [int(s) for s in batch.seq_lens]
        lengths = table_lengths(batch)                                           # [P, S]
        in_use = [[0 < s <= n * bs for n, s in zip(plane, seq_lens)] for plane in lengths.tolist()]
        # a sequence without KV in a plane attends its own queries over block 0 (valid for the kernel)
        # and its output rows are zeroed afterwards, as the CPU reference leaves them
        kv_lens = [[s if used else q for used, q, s in zip(flags, query_lens, seq_lens)] for flags in in_use]
        unused_need = [-(-q // bs) for flags in in_use for used, q in zip(flags, query_lens) if not used]
        widest = max([int(lengths.max()) if lengths.size else 0] + unused_need + [1])
        if max_blocks and widest > max_blocks:
            raise ValueError(f"a block table needs {widest} blocks, the meta has room for {max_blocks} "
                             f"(MetaCapacity.max_blocks_per_seq)")
        tables = block_table_array(batch, max(widest, max_blocks))
        for p, flags in enumerate(in_use):
            for i, used in enumerate(flags):
                if not used:
                    tables[p, i] = 0
        slots = slot_mapping(batch)                                                # [P, T] int64
        if check_slots:
            _check_unique_slots(slots)
        starts = [0, *itertools.accumulate(query_lens)]
        write_rows, unused_rows = [], []
        for p, flags in enumerate(in_use):
            keep = np.flatnonzero(slots[p] >= 0)
            write_rows.append(None if len(keep) == slots.shape[1] else self._rows(keep))
            unused = [r for i, used in enumerate(flags) if not used for r in range(starts[i], starts[i + 1])]
            unused_rows.append(self._rows(np.asarray(unused)) if unused else None)
        return AscendMeta(
            cum_query_lens=starts[1:], kv_lens=kv_lens,
            context_lens=[torch.tensor(lens, dtype=torch.int32) for lens in kv_lens],
            block_tables=torch.from_numpy(tables).to(self.device),
            slot_mapping=torch.from_numpy(slots.astype(np.int32)).to(self.device),
            write_rows=write_rows, unused_rows=unused_rows,
            is_decode=bool(query_lens) and all(q == 1 for q in query_lens))

    def _rows(self, rows: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(rows.astype(np.int64)).to(self.device)

    def update_meta(self, meta: AscendMeta, batch: PagedBatch) -> list[dict[str, Any]]:
        """Rewrite `meta` in place for `batch`, keeping its device tensors (their addresses are
        captured in graphs), and return the host arguments of the updatable calls captured with
        `meta`, in capture order (`Graph.update` takes them; [] before any capture). The batch must
        have the captured shape: same query lengths, every plane in use, tables within the width."""
        new = self._build(batch, check_slots=True)          # tables as wide as the batch's longest
        width, room = new.block_tables.shape[-1], meta.block_tables.shape[-1]
        if width > room:
            raise ValueError(f"a block table needs {width} blocks, the meta has room for {room} "
                             f"(MetaCapacity.max_blocks_per_seq)")
        if (new.cum_query_lens != meta.cum_query_lens or new.block_tables.shape[:2] != meta.block_tables.shape[:2]
                or any(r is not None for r in (*new.write_rows, *new.unused_rows, *meta.write_rows,
                                               *meta.unused_rows))):
            raise ValueError("update_meta needs a batch of the captured shape (same query lengths, planes, "
                             "sequences; every plane in use by every sequence)")
        meta.block_tables[..., :width].copy_(new.block_tables)      # the columns past it: never attended over
        meta.slot_mapping.copy_(new.slot_mapping)
        for p in range(len(meta.kv_lens)):
            meta.kv_lens[p][:] = new.kv_lens[p]
            meta.context_lens[p].copy_(new.context_lens[p])
        return [self._host_params(meta, site, plane) for site, plane in meta.graph_calls]

    def _host_params(self, meta: AscendMeta, site: str, plane: int) -> dict[str, Any]:
        if site == "paged_decode_attention":
            return {"context_lens": meta.context_lens[plane].clone()}
        return {"actual_seq_lengths": list(meta.cum_query_lens),
                "actual_seq_lengths_kv": list(meta.kv_lens[plane])}

    def _note_capture(self, meta: AscendMeta, site: str, plane: int) -> None:
        """Inside a graph capture: remember the updatable call on `meta` and log it for the graph."""
        if meta.captured_in is not self.ops.capture_log:          # a new capture: forget an older one
            meta.captured_in, meta.graph_calls = self.ops.capture_log, []
        meta.graph_calls.append((site, plane))
        self.ops.record(site, self, plane, self._host_params(meta, site, plane))

    # ----- KV write and attention -------------------------------------------------------------
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AscendMeta,
                 plane: int) -> None:
        slots, rows = meta.slot_mapping[plane], meta.write_rows[plane]
        if rows is not None:            # the kernel takes no -1 slots: drop the rows without one
            k, v, slots = k.index_select(0, rows), v.index_select(0, rows), slots.index_select(0, rows)
        if slots.shape[0]:
            self.ops.scatter_kv(k.to(kv_cache.dtype).contiguous(), v.to(kv_cache.dtype).contiguous(),
                                kv_cache[0], kv_cache[1], slots)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AscendMeta, plane: int,
                scale: float) -> torch.Tensor:
        query = q.to(kv_cache.dtype).contiguous()                                  # [T, H, D]
        if self.paged_decode and meta.is_decode:
            out = self.ops.paged_decode_attention(
                query, kv_cache[0], kv_cache[1], block_table=meta.block_tables[plane],
                context_lens=meta.context_lens[plane], num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, scale=scale, out=torch.empty_like(query))
            site = "paged_decode_attention"
        else:
            num_blocks = kv_cache.shape[1]
            bnbsh = (num_blocks, self.block_size, self.num_kv_heads * self.head_dim)
            out = self.ops.fused_infer_attention(
                query, kv_cache[0].view(bnbsh), kv_cache[1].view(bnbsh), atten_mask=self.mask,
                block_table=meta.block_tables[plane], cum_query_lens=meta.cum_query_lens,
                kv_lens=meta.kv_lens[plane], num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                scale=scale, block_size=self.block_size)
            site = "fused_infer_attention"
        if self.ops.capturing:
            self._note_capture(meta, site, plane)
        rows = meta.unused_rows[plane]
        if rows is not None:
            out = out.index_fill(0, rows, 0)
        return out.to(q.dtype)


def _check_unique_slots(slots: np.ndarray) -> None:
    """`slots: [P, T]`. npu_scatter_pa_kv_cache requires the slots of one call to be unique (its docs:
    accuracy is not guaranteed otherwise): refuse a batch that repeats one, e.g. graph padding rows
    sharing a scratch slot, on the host rather than get undefined KV on the NPU."""
    for plane, row in enumerate(slots):
        values, counts = np.unique(row[row >= 0], return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"plane {plane}: KV slots {values[counts > 1][:4].tolist()} are written by more "
                             f"than one token of the step; the Ascend KV write needs unique slots (give "
                             f"each graph padding row its own scratch slot)")


class FallbackAttention(TorchPagedAttention):
    """The reference paged attention in plain torch, run on the NPU, for shapes the fused op
    cannot take; same cache layout as `FusedAttention`, not graph-safe (host syncs)."""

    def __init__(self, *args: Any, reason: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reason = reason

    @property
    def caps(self) -> AttnCaps:
        return AttnCaps(packed_prefill=True, graphs=False, reason=self.reason)
