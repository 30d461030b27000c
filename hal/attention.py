"""The attention contract: what a vendor's paged attention implements (`AttentionBackend`), the host
data it is built from (`PagedBatch`, `MetaCapacity`), what it reports (`AttnCaps`), and attention
without a cache (`dense_attention`, the default of `Hal.dense`).

A Hal chooses the backend (`Hal.attention`); the runtime only allocates the caches the backend
shapes and hands each step's `PagedBatch` to it, so every vendor's kernels sit behind these names.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple, Sequence

import torch


class AttnCaps(NamedTuple):
    packed_prefill: bool      # varlen queries of many sequences in one call
    graphs: bool              # safe to capture (no host syncs, static metadata buffers)
    reason: str               # why this backend was chosen (logged once at start)
    # widest prompt chunk with prior context worth capturing (None: any): a captured pass's tables
    # have room for max_model_len, and a backend whose work grows with their width (Ascend's int8
    # prefill dequantizes every block they name) runs wider chunks eagerly over tables of their own
    max_context_prefill_width: int | None = None
    # a captured pass may take packed batches of any query lengths within its capacity (prompt chunks
    # and decodes together, `MetaCapacity.packed`): the kernels' shapes depend on the token and
    # sequence counts only, and a sequence may have no tokens (a padding slot)
    packed_graphs: bool = False
    # the shortest prompt chunk without prior context that attends through the backend's fresh path (a
    # vendor's kernel over its own new K/V, `MetaCapacity.fresh`), captured or eager alike, so that turning
    # graphs off never changes the attention kernel; None: the backend has no fresh path
    fresh_min_tokens: int | None = None


class PagedBatch(NamedTuple):
    """Host description of one attention batch over the paged cache (host values, no tensors).

    Sequence i contributes `query_lens[i]` new tokens, the last ones of its `seq_lens[i]` tokens,
    so the new tokens sit at positions `seq_lens[i] - query_lens[i] ... seq_lens[i] - 1`. Tokens
    are packed sequence after sequence ("varlen", no padding). `block_tables[p][i]` lists the
    cache blocks of sequence i in KV plane p; every plane shares one block pool. The tables are
    either nested lists, or (a runtime's persistent batch) one int32 array `[P, S, B]` whose rows are
    valid up to `table_lengths[p, i]` (then `table_lengths` is given; read both through
    `hal.common.paged`). `query_lens` and `seq_lens` may be int arrays.
    """

    query_lens: Sequence[int]
    seq_lens: Sequence[int]
    block_tables: Sequence[Sequence[Sequence[int]]]   # [plane][seq][block], or int32 [P, S, B]
    block_size: int
    table_lengths: Any = None                          # int [P, S] when block_tables is an array


class MetaCapacity(NamedTuple):
    """Static sizes of metadata that graphs capture: `update_meta` refills it in place for any batch
    within these bounds, so captured kernels keep reading the same addresses."""

    max_num_seqs: int
    max_num_tokens: int
    max_blocks_per_seq: int
    num_planes: int
    max_seq_len: int
    # every batch is prefills without prior context (each sequence attends over its own new K/V
    # only): a backend may capture its fresh path (`attend`) for them; `update_meta` refuses others
    fresh: bool = False
    # a batch may have prior context (False: prompts' only chunks, tables of their own width)
    context: bool = True
    # any mix of query lengths up to `max_num_tokens` in all (`AttnCaps.packed_graphs`); else every
    # batch has the captured one's longest query
    packed: bool = False


class AttentionBackend(ABC):
    """Paged attention for one model shape (heads, kv heads, head dim, dtype), chosen by the Hal.

    Layout of the KV cache (one tensor per attention layer of a plane) is the backend's business:
    callers allocate `torch.empty(kv_cache_shape(...))` and only pass it back. `build_meta` turns a
    `PagedBatch` into whatever the kernels need once per step; `forward` and `write_kv` then take a
    plane index so that all loops and layers share that one metadata object.

    `kv_dtype` (an 8-bit format of `hal.common.kv_quant.QUANT_MAX`, or None for `dtype`) quantizes the cache:
    `write_kv` stores each token's K and V with one scale per KV head, `forward` dequantizes on load,
    `read_kv` returns dequantized values; caches are then raw bytes (`kv_cache_dtype` uint8) in
    `kv_layout` unless the backend documents its own.
    """

    name: ClassVar[str]

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int, *, kv_dtype: torch.dtype | None = None) -> None:
        from hal.common.kv_quant import QuantLayout, is_quantized

        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if kv_dtype not in (None, dtype) and not is_quantized(kv_dtype):
            raise ValueError(f"kv_dtype {kv_dtype}: a quantized cache takes float8_e4m3fn, float8_e4m3fnuz or "
                             f"int8; None keeps the model dtype {dtype}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.kv_dtype = kv_dtype or dtype
        self.kv_layout = (QuantLayout(num_kv_heads, head_dim, block_size, kv_dtype) if is_quantized(kv_dtype)
                          else None)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype to allocate `kv_cache_shape` in: the model dtype, or uint8 bytes when quantized."""
        return torch.uint8 if self.kv_layout is not None else self.dtype

    @property
    @abstractmethod
    def caps(self) -> AttnCaps: ...

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's K+V cache holding `num_blocks` blocks of `block_size` tokens."""

    @abstractmethod
    def build_meta(self, batch: PagedBatch, capacity: MetaCapacity | None = None) -> Any:
        """Device metadata for one step: query offsets, lengths, per-plane block tables and slot
        mappings. Built once, shared by every loop and layer of the step. With `capacity` the
        tensors are sized for it (for graphs; see `update_meta`)."""

    def update_meta(self, meta: Any, batch: PagedBatch) -> list[dict[str, Any]]:
        """Refill `meta` (built with a capacity) in place for `batch`, keeping every device address.
        Returns the host-side parameters captured graphs need refreshed (`Graph.update`): [] where
        kernels read lengths from device memory. Backends without graph support raise."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot run in captured graphs")

    def advance_meta(self, meta: Any, steps: int) -> Any | None:
        """The metadata of a decode batch (one query token per sequence) `steps` positions further on:
        every sequence one token longer per step, each token's slot the next of its table. Computed
        on the device from `meta` (capturable in the same graph: speculation's draft passes chain this
        way), equal to `build_meta` of the advanced batch wherever the tables reach the new positions.
        None where lengths live on the host (then each pass needs its own `update_meta`)."""
        return None

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: Any, plane: int) -> None:
        """Store the step's new keys/values `k, v: [T, KVH, D]` into plane `plane` of `kv_cache`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: Any, plane: int,
                scale: float) -> torch.Tensor:
        """Causal attention of the packed queries `q: [T, H, D]` over plane `plane` (which
        already holds this step's keys). Returns `[T, H, D]` in q's dtype."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
               plane: int, scale: float) -> torch.Tensor:
        """`write_kv(k, v)` then `forward(q)`: what a layer does each step. A backend may attend over
        the fresh `k, v` directly where the plane holds nothing older for any sequence (prefill
        without context), as long as the result is the same attention."""
        self.write_kv(k, v, kv_cache, meta, plane)
        return self.forward(q, kv_cache, meta, plane, scale)

    def attend_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                      plane: int, positions: torch.Tensor, theta: float, interleaved: bool,
                      scale: float) -> torch.Tensor | None:
        """`attend` of `q: [T, H, D]` and `k: [T, KVH, D]` rotated at `positions: [T]` (NeoX halves,
        or adjacent pairs when `interleaved`), the rotation in the KV write's kernel. None where the
        backend has no such kernel for this cache: the caller then rotates and calls `attend`."""
        return None

    def slot_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """A 16-bit cache as `[2, num_blocks * block_size, KVH, D]` (K then V); the default fits every
        layout whose blocks are contiguous runs of slots. A quantized cache has no such view: a slot's
        values and scales lie apart (`kv_layout`)."""
        if self.kv_layout is not None:
            raise ValueError("a quantized KV cache has no slot view: its values and scales lie apart; use "
                             "kv_layout (values, scales, read_slots, copy_slots) or read_kv / copy_kv")
        return kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)

    def read_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[N, KVH, D]` stored at `slots: [N]` (dequantized, in the model dtype)."""
        if self.kv_layout is not None:
            return (self.kv_layout.read_slots(kv_cache, 0, slots, self.dtype),
                    self.kv_layout.read_slots(kv_cache, 1, slots, self.dtype))
        view = self.slot_view(kv_cache)
        return view[0].index_select(0, slots), view[1].index_select(0, slots)

    def block_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of everything the cache stores, each `[2, num_blocks, ...]` (dim 1 = block): what
        swap copies to host and back. The default fits every slot-major layout and `kv_layout`."""
        if self.kv_layout is not None:
            return self.kv_layout.block_views(kv_cache)
        view = self.slot_view(kv_cache)
        return (view.unflatten(1, (-1, self.block_size)),)

    def copy_kv(self, kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy the KV of `src_slots` to `dst_slots` (early-exit fill into the planes a token skipped)."""
        if self.kv_layout is not None:
            self.kv_layout.copy_slots(kv_cache, src_slots, dst_slots)
            return
        view = self.slot_view(kv_cache)
        view[:, dst_slots] = view[:, src_slots]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    causal: bool = True) -> torch.Tensor:
    """torch SDPA with GQA expansion and a bottom-right causal mask. Shapes as `Hal.dense`."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads != num_kv_heads:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    q_len, kv_len = q.shape[2], k.shape[2]
    if causal and q_len == kv_len:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if q_len == 1:   # one query at the end sees every key (and torch's CPU SDPA is slow with a 1-row mask)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    mask = None
    if causal:
        # bottom-right: query i sees keys 0 .. kv_len - q_len + i
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
