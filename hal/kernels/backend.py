"""`TritonPagedAttention`: the attention backend the CUDA and ROCm Hals build on hal/kernels.

Cache layout as the CPU reference, `[2, num_blocks, block_size, KVH, D]`, so caches, slot
mappings and `read_kv`/`copy_kv` carry over unchanged; an FP8 cache (`kv_dtype`) is the reference's
`QuantLayout` too (hal/common/kv_quant.py), which the kernels read through strided values/scales views.

Prefill chunks without prior context (every sequence of the batch starts at position 0) may attend
over their fresh K/V through torch's vendor kernel instead (`attend`, `fresh_attention` mode chosen
by the Hal, hal/kernels/fresh.py); the cache is written all the same (over an 8-bit cache they
attend over its quantized K/V). Decode-like batches and float32 always take the paged kernel.
Prompts without context that stay on the paged kernel (shorter than `fresh_min_tokens`, and on Hopper
every batch cuDNN does not take: several prompts, grouped-query heads) read
their K/V from this step's own tensors, not back from the cache (`TritonMeta.own_kv`;
hal/kernels/attend.py): over an 8-bit cache from what the quantizing write hands back dequantized, on
the 16-bit tile; over a 16-bit cache from the rotated k and a copy of v that the fused rotary write
hands back, the same values the cache holds, so the same bits.

Graphs: `forward`/`write_kv` read lengths and tables from device tensors only and never sync; the
launch grid depends on `q.shape[0]`, the number of sequences and `meta.max_query_len`, so a captured
bucket must keep those fixed (decode buckets: `max_query_len == 1`), and its metadata tensors must
live at fixed addresses (the runner copies each step's values into them).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

from hal.attention import AttentionBackend, AttnCaps, MetaCapacity, PagedBatch
from hal.common.paged import block_table_array, query_start_loc, slot_mapping, table_lengths
from hal.common.staging import StagingRing
from hal.kernels import fresh
from hal.kernels.attend import fuses_rotary, paged_attention
from hal.kernels.attention import DECODE_MAX_QUERY_LEN
from hal.kernels.configs import KernelConfig, configs_for
from hal.kernels.kv_write import write_kv
from hal.kernels.launch import target_of
from hal.kernels.row_decode import NewKV

DEFAULT_CPU_COMPUTE_UNITS = 4     # the interpreter has no SMs; enough to exercise the context split
MAX_HEAD_DIM = 128
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


class TritonMeta(NamedTuple):
    query_start_loc: torch.Tensor   # [S + 1] int32 cumulative query offsets
    seq_lens: torch.Tensor          # [S] int32 cached tokens per sequence, this step's included
    block_tables: torch.Tensor      # [P, S, max_blocks] int32
    slot_mapping: torch.Tensor      # [P, T] int64, -1 = do not write
    max_query_len: int              # host ints: pick the config and the context split
    max_seq_len: int
    fresh_lens: tuple[int, ...] | None = None   # query lengths when the batch takes the fresh path
    # prompts without context outside the fresh path: the paged kernel attends over this step's own K/V
    # (an 8-bit cache's dequantized by its write), not the cache (attend.paged_attention `own_kv`)
    own_kv: bool = False
    packed: bool = False            # any query lengths (MetaCapacity.packed): max_query_len is the capacity's
    mixed: bool = False             # prompt chunks beside one-token sequences (packed: maybe): attend.launches_for
    # a capacity-built meta's pinned host mirrors: update_meta stages each step's values there and
    # copies them asynchronously into these same device tensors, whose addresses graphs captured
    staging: StagingRing | None = None


@functools.cache              # a device's size does not change; kernels without a Hal object ask per call
def device_compute_units(device: torch.device) -> int:
    """SMs / CUs of `device` from Triton's driver (CPU: a small stand-in for the interpreter)."""
    if device.type == "cpu":
        return DEFAULT_CPU_COMPUTE_UNITS
    from triton.runtime import driver

    index = device.index if device.index is not None else driver.active.get_current_device()
    return int(driver.active.utils.get_device_properties(index)["multiprocessor_count"])


class TritonPagedAttention(AttentionBackend):
    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int, configs: dict[str, KernelConfig] | None = None,
                 num_compute_units: int | None = None, kv_dtype: torch.dtype | None = None,
                 fresh_attention: str | None = None, fresh_min_tokens: int = fresh.MIN_TOKENS) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, dtype, device, block_size, kv_dtype=kv_dtype)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"triton attention takes float32, bfloat16 or float16, not {dtype}")
        if self.kv_layout is not None and self.kv_dtype not in FP8_KV_DTYPES:
            raise ValueError(f"triton attention quantizes KV to FP8 ({' or '.join(map(str, FP8_KV_DTYPES))}), "
                             f"not {self.kv_dtype}; use the torch backend for int8")
        if head_dim > MAX_HEAD_DIM:     # the configs are compile-checked at padded head dim 128
            raise ValueError(f"triton attention takes head_dim <= {MAX_HEAD_DIM}, not {head_dim}; "
                             "use the torch backend")
        self.configs = configs if configs is not None else configs_for(target_of(torch.device(device)).arch)
        self.num_compute_units = num_compute_units or device_compute_units(torch.device(device))
        # "flash" / "sdpa" for prefill without context (hal/kernels/fresh.py), where it serves
        usable = fresh.usable(fresh_attention, dtype, head_dim)
        self.fresh_attention = fresh_attention if usable else None
        # shorter prompts attend over their own K/V on the paged kernel (fresh.MIN_TOKENS says why)
        self.fresh_min_tokens = max(fresh_min_tokens, DECODE_MAX_QUERY_LEN + 1)

    @property
    def caps(self) -> AttnCaps:
        # whether one prompt alone takes the fresh path at all (cuDNN's needs as many KV heads as heads)
        n = self.fresh_min_tokens
        alone = fresh.takes(self.fresh_attention, [n], [n], n, self.num_heads, self.num_kv_heads)
        return AttnCaps(packed_prefill=True, graphs=True, packed_graphs=True,
                        fresh_min_tokens=n if alone else None,
                        reason="Triton unified paged attention (hal/kernels): varlen prefill, chunked "
                               "prefill and split-context decode in one kernel, no host syncs")

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.kv_layout is not None:
            return self.kv_layout.cache_shape(num_blocks)
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def _views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(values `[2, NB, page, KVH, D]`, scales `[2, NB, page, KVH]` or None) of one layer's cache."""
        if self.kv_layout is None:
            return kv_cache, None
        return self.kv_layout.values(kv_cache), self.kv_layout.scales(kv_cache)

    def _host_arrays(self, batch: PagedBatch, max_blocks: int | None = None) -> list[np.ndarray]:
        if batch.block_size != self.block_size:
            raise ValueError(f"batch block_size={batch.block_size} != backend block_size={self.block_size}")
        tables = block_table_array(batch, max_blocks)
        return [np.ascontiguousarray(a) for a in (query_start_loc(batch), np.asarray(batch.seq_lens, dtype=np.int32),
                                                  tables, slot_mapping(batch, tables))]

    def build_meta(self, batch: PagedBatch, capacity: MetaCapacity | None = None) -> TritonMeta:
        arrays = self._host_arrays(batch, capacity.max_blocks_per_seq if capacity else None)
        tensors = [torch.from_numpy(a).to(self.device, non_blocking=True) for a in arrays]
        # a captured pass takes the fresh path only where its capacity promises prefills without context
        is_fresh = (capacity is None or capacity.fresh) and fresh.takes(
            self.fresh_attention, batch.query_lens, batch.seq_lens, self.fresh_min_tokens, self.num_heads,
            self.num_kv_heads)
        packed = capacity is not None and capacity.packed
        if packed and capacity.fresh:
            raise ValueError("a packed capacity attends through the paged kernel, not the fresh path")
        # a packed pass always launches the paged kernel's prefill config (a max query length past the
        # decode configs'), whose grid follows the token and sequence counts alone, so any batch
        # within the capacity replays it
        longest = max(capacity.max_num_tokens, DECODE_MAX_QUERY_LEN + 1) if packed else max(batch.query_lens, default=0)
        mixed = packed or (capacity is None and longest > DECODE_MAX_QUERY_LEN and 1 in batch.query_lens)
        # a captured pass has no context where its capacity says so (a prompt's first chunk, whose
        # padding rows may start inside a scratch block: the kernel attends each over its own rows)
        no_context = not capacity.context if capacity is not None else \
            fresh.without_context(batch.query_lens, batch.seq_lens)
        own_kv = bool(not is_fresh and not mixed and no_context and longest > DECODE_MAX_QUERY_LEN)
        return TritonMeta(*tensors, max_query_len=longest,
                          max_seq_len=capacity.max_seq_len if capacity else max(batch.seq_lens, default=0),
                          fresh_lens=tuple(map(int, batch.query_lens)) if is_fresh and not packed else None,
                          own_kv=own_kv, packed=packed, mixed=mixed,
                          staging=None if capacity is None else StagingRing(arrays, self.device))

    def update_meta(self, meta: TritonMeta, batch: PagedBatch) -> list[dict]:
        """Refill a capacity-built `meta` in place: same shapes (the captured bucket), new values."""
        staging = meta.staging
        if staging is None:
            raise ValueError("update_meta needs a meta built with a capacity (build_meta(batch, capacity))")
        longest = max(batch.query_lens, default=0)
        if longest != meta.max_query_len and not (meta.packed and longest <= meta.max_query_len):
            raise ValueError("a captured meta takes batches with the same max query length")
        if meta.fresh_lens is not None and (tuple(map(int, batch.query_lens)) != meta.fresh_lens or not fresh.takes(
                self.fresh_attention, batch.query_lens, batch.seq_lens, self.fresh_min_tokens, self.num_heads,
                self.num_kv_heads)):
            raise ValueError(f"a captured fresh prefill takes prefills without context of {meta.fresh_lens} tokens")
        # the tables travel as wide as the batch's own (not the capacity's max_model_len): its longest
        # table, and in a padded array the padding rows' spare scratch column, which advance_meta
        # steps into (step_inputs.pad)
        room, widest = meta.block_tables.shape[-1], int(table_lengths(batch).max(initial=0))
        if widest > room:
            raise ValueError(f"a block table has {widest} blocks, the captured meta has room for {room} "
                             f"(MetaCapacity.max_blocks_per_seq)")
        own = batch.block_tables.shape[2] if isinstance(batch.block_tables, np.ndarray) else widest
        staging.stage(self._host_arrays(batch, max(1, min(own, room))), meta[:4], narrow=(2,))
        return []

    def advance_meta(self, meta: TritonMeta, steps: int) -> TritonMeta:
        """Device-side (capturable): `seq_lens + steps` and the slots of the advanced positions, read
        from the block tables. The tables must reach the new positions (a speculation round's blocks
        are allocated for all of them; padding rows own two scratch blocks, enough for steps <= block_size)."""
        if meta.max_query_len != 1:
            raise ValueError("advance_meta takes decode metadata (one query token per sequence)")
        seq_lens = meta.seq_lens + steps
        positions = seq_lens.long() - 1                                                    # [S]
        index = (positions // self.block_size).clamp(max=meta.block_tables.shape[-1] - 1)
        blocks = meta.block_tables.gather(2, index[None, :, None].expand(meta.block_tables.shape[0], -1, 1))[..., 0]
        slots = blocks.long() * self.block_size + positions % self.block_size              # [P, S]
        slots = torch.where(meta.slot_mapping >= 0, slots, meta.slot_mapping)              # unused planes stay unused
        return meta._replace(seq_lens=seq_lens, slot_mapping=slots)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: TritonMeta,
                 plane: int, dequantize: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """With `dequantize`, an 8-bit cache's write also returns the K and V it now holds (fresh.py)."""
        values, scales = self._views(kv_cache)
        return write_kv(k, v, values, meta.slot_mapping[plane], self.configs["kv_write"], scales, dequantize)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: TritonMeta,
               plane: int, scale: float) -> torch.Tensor:
        """`write_kv`, then `forward`; a batch of prefills without context (`meta.fresh_lens`)
        attends over its fresh k, v through torch's vendor kernel instead of reading the cache back."""
        if meta.fresh_lens is not None:
            held = self.write_kv(k, v, kv_cache, meta, plane, dequantize=True)
            if held is not None:                  # an 8-bit cache: attend over what it holds (fresh.py)
                k, v = held
            return fresh.attention(self.fresh_attention, q, k, v, meta.query_start_loc, meta.fresh_lens, scale)
        if meta.own_kv:
            held = self.write_kv(k, v, kv_cache, meta, plane, dequantize=True)
            if held is None:                      # a 16-bit cache holds k and v themselves
                same = k.stride() == v.stride() and k.stride(-1) == 1
                held = (k, v) if same else (k.contiguous(), v.contiguous())
            return self._own_kv_attention(q, kv_cache, meta, plane, scale, held)
        self.write_kv(k, v, kv_cache, meta, plane)
        return self.forward(q, kv_cache, meta, plane, scale)

    def _own_kv_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: TritonMeta, plane: int,
                          scale: float, held: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The paged kernel over this step's K/V `held` (`meta.own_kv`): what the cache now holds."""
        values, _ = self._views(kv_cache)
        return paged_attention(q, values, meta.block_tables[plane], meta.seq_lens, meta.query_start_loc,
                               meta.max_query_len, scale, self.configs, self.num_compute_units, own_kv=held)

    def attend_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                      meta: TritonMeta, plane: int, positions: torch.Tensor, theta: float, interleaved: bool,
                      scale: float) -> torch.Tensor | None:
        """Rotary embedding of q `[T, H, D]` and k `[T, KVH, D]` at `positions: [T]` with the KV
        write of plane `plane` in one launch (hal/kernels/rotary_kv.py; over an 8-bit cache the
        write quantizes), then attention: the paged kernel, or for a batch of prefills without
        context the fresh path over the rotated k, which the same launch hands back, with v as its own
        tensor where cuDNN attends (over an 8-bit cache: over the K and V the cache now holds,
        dequantized, which the launch hands back too).
        Small multi-head decode batches rotate and store inside the row kernel instead: one launch
        (`attend.fuses_rotary`, hal/kernels/row_decode.py)."""
        from hal.kernels.ops import _inv_freq
        from hal.kernels.rotary_kv import rotary_kv_write

        slots, config = meta.slot_mapping[plane], self.configs["rotary"]
        values, scales = self._views(kv_cache)
        if meta.fresh_lens is not None:
            # v stays a view of the q|k|v output: cuDNN attends as fast over it as over a copy, which
            # costs its own write (lever 101, measured on an H100: docs/performance.md)
            q, k, v = rotary_kv_write(q, k, v, positions, theta, interleaved, values, slots, config, keep_kv=True,
                                      kv_scales=scales, copy_v=False)
            return fresh.attention(self.fresh_attention, q, k, v, meta.query_start_loc, meta.fresh_lens, scale)
        if meta.own_kv:           # k rotated and v as the cache holds them (dequantized where it is 8-bit)
            q, k, v = rotary_kv_write(q, k, v, positions, theta, interleaved, values, slots, config,
                                      keep_kv=True, kv_scales=scales, copy_v=True)
            return self._own_kv_attention(q, kv_cache, meta, plane, scale, (k, v))
        if q.dtype == self.dtype and fuses_rotary(q.dtype, self.num_heads, self.num_kv_heads, meta.max_query_len,
                                                  scales is not None, self.configs, meta.seq_lens.shape[0],
                                                  self.num_compute_units):
            # small multi-head decode batches: the row kernel rotates q and stores k, v itself
            q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
            new_kv = NewKV(k, v, positions, _inv_freq(self.head_dim, float(theta), q.device), slots, interleaved)
            return paged_attention(q, values, meta.block_tables[plane], meta.seq_lens, meta.query_start_loc,
                                   meta.max_query_len, scale, self.configs, self.num_compute_units, scales,
                                   new_kv=new_kv)
        q = rotary_kv_write(q, k, v, positions, theta, interleaved, values, slots, config, kv_scales=scales)
        return self.forward(q, kv_cache, meta, plane, scale)

    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: TritonMeta, plane: int,
                scale: float) -> torch.Tensor:
        if q.dim() != 3 or q.shape[1:] != (self.num_heads, self.head_dim):
            raise ValueError(f"q must be [T, {self.num_heads}, {self.head_dim}], got {tuple(q.shape)}")
        values, scales = self._views(kv_cache)
        if scales is None and q.dtype != kv_cache.dtype:
            raise ValueError(f"q is {q.dtype} but the cache is {kv_cache.dtype}; cast q to the cache dtype")
        if scales is not None and q.dtype != self.dtype:
            raise ValueError(f"q is {q.dtype} but the backend computes in {self.dtype} over an 8-bit cache; "
                             f"cast q to the model dtype {self.dtype}")
        return paged_attention(q, values, meta.block_tables[plane], meta.seq_lens, meta.query_start_loc,
                               meta.max_query_len, scale, self.configs, self.num_compute_units, scales,
                               mixed=meta.mixed)
