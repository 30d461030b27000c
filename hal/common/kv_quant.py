"""8-bit KV cache: the quantization every backend shares, and the cache layout.

Scales: one float32 scale per (token, KV head), computed when the token's K or V is written:
`scale = absmax(x[token, head, :]) / QMAX`, `q = clamp(x / scale, -QMAX, QMAX)` rounded to the 8-bit
format (round-to-nearest-even; int8 rounds to the nearest integer), and `x ~ q * scale` on load.
Why per token: a slot's scale depends on that token's values only, so it is fixed the moment the
slot is written and never changes, which makes everything that moves or shares KV exact with no
extra rule: prefix-cache blocks shared between requests, blocks swapped to host and back, the
last_exited copy into deeper planes, speculation's overwrite on rollback, chunked prefill (a
chunk's quantization does not depend on where the chunk boundary fell), graph padding rows. There is
no calibration pass, no running statistic, no host sync: the scale is computed on the device inside
the KV write, so the write stays capturable in graphs. The cost is 4 bytes per (token, head) next to
`head_dim` bytes of values (3% at head dim 128).

Layout (`QuantLayout`; every backend: the CPU reference, the Triton kernels, Ascend's fused op): one
uint8 tensor per layer `[2, num_blocks * block_bytes]`, K then V; each half holds the values of every
block `[NB, block_size, KVH, D]` (slot-major, as a 16-bit cache holds them), then the scales of every
block `[NB, KVH, block_size]` float32. Why scales head-major per block: a decode kernel reads one KV
head's keys a tile at a time, and a tile's scales are then one contiguous run (a 32-byte sector for 8
keys) instead of one sector per key (H200, FP8 row kernel at 128 x 1K: docs/performance.md, lever
70); it is also the layout Ascend's paged antiquant takes (`antiquant_mode=5`). A slot's bytes are
therefore two pieces: `copy_slots`, `read_slots` and `block_views` (swap) move both.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

QUANT_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0, torch.int8: 127.0}
KV_DTYPE_NAMES = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e4m3fnuz": torch.float8_e4m3fnuz, "int8": torch.int8}


def is_quantized(kv_dtype: torch.dtype | None) -> bool:
    return kv_dtype in QUANT_MAX


def quant_max(dtype: torch.dtype) -> float:
    if dtype not in QUANT_MAX:
        raise ValueError(f"{dtype} is not an 8-bit KV format; known: {', '.join(map(str, QUANT_MAX))}")
    return QUANT_MAX[dtype]


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: [..., D]` -> (`q: [..., D]` in `dtype`, `scale: [...]` float32), one scale per vector."""
    qmax = quant_max(dtype)
    x32 = x.float()
    scale = x32.abs().amax(-1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))    # an all-zero vector stores zeros
    q = (x32 / scale[..., None]).clamp(-qmax, qmax)
    if not dtype.is_floating_point:
        q = q.round()
    return q.to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`q: [..., D]`, `scale: [...]` -> `q * scale` in `dtype` (the product in float32)."""
    return (q.float() * scale[..., None]).to(dtype)


def fake_quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x: [..., D]` as an 8-bit cache gives it back: quantized per vector, dequantized to x's dtype."""
    return dequantize(*quantize(x, dtype), x.dtype)


class QuantLayout(NamedTuple):
    """Where a quantized cache keeps values and scales: per half (K, then V) the values of every
    block `[NB, block_size, KVH, D]`, then the scales of every block `[NB, KVH, block_size]`."""

    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype              # the 8-bit format of the values

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot takes in one half: its values and its scales."""
        return self.num_kv_heads * (self.head_dim + 4)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.slot_bytes

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        slots = self.block_size * self.num_kv_heads
        if slots % 4 or (slots * self.head_dim) % 16:
            # every region (K values, K scales, V values, V scales) then starts on a 16-byte boundary
            raise ValueError(f"a quantized cache needs block_size * num_kv_heads to be a multiple of 4 and "
                             f"block_size * num_kv_heads * head_dim of 16 (aligned regions for vector loads), "
                             f"got block_size {self.block_size}, {self.num_kv_heads} KV heads of "
                             f"{self.head_dim}; a block_size that is a multiple of 16 always fits")
        return (2, num_blocks * self.block_bytes)

    def num_blocks(self, cache: torch.Tensor) -> int:
        return cache.shape[1] // self.block_bytes

    def _values_end(self, cache: torch.Tensor) -> tuple[int, int]:
        """(blocks, where each half's values end and its scales begin, in bytes)."""
        num_blocks = self.num_blocks(cache)
        return num_blocks, num_blocks * self.block_size * self.num_kv_heads * self.head_dim

    def value_bytes(self, cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, bs, KVH, D]` uint8, a view of `cache` (torch's indexing ops take bytes where
        they take no float8)."""
        num_blocks, end = self._values_end(cache)
        return cache[:, :end].view(2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def values(self, cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, bs, KVH, D]` in `dtype`, a view of `cache`."""
        return self.value_bytes(cache).view(self.dtype)

    def head_scales(self, cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, KVH, bs]` float32 as stored (each half's part contiguous), a view of `cache`."""
        num_blocks, start = self._values_end(cache)
        return cache[:, start:].view(torch.float32).view(2, num_blocks, self.num_kv_heads, self.block_size)

    def scales(self, cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, bs, KVH]` float32 indexed as the values are (a strided view; kernels take its strides)."""
        return self.head_scales(cache).transpose(2, 3)

    def write(self, cache: torch.Tensor, plane_kv: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize `x: [T, KVH, D]` into slots `slots: [T]` of K (`plane_kv=0`) or V (1), in place."""
        q, scale = quantize(x, self.dtype)
        self.value_bytes(cache)[plane_kv].flatten(0, 1).index_copy_(0, slots, q.view(torch.uint8))
        self.head_scales(cache)[plane_kv][self.slot_index(slots)] = scale

    def read_blocks(self, cache: torch.Tensor, plane_kv: int, blocks: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized K (0) or V (1) of `blocks: [N]`, `[N, bs, KVH, D]`."""
        values = self.value_bytes(cache)[plane_kv].index_select(0, blocks).view(self.dtype)
        return dequantize(values, self.scales(cache)[plane_kv].index_select(0, blocks), dtype)

    def read_slots(self, cache: torch.Tensor, plane_kv: int, slots: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized K (0) or V (1) `[N, KVH, D]` stored at `slots: [N]`."""
        values = self.value_bytes(cache)[plane_kv].flatten(0, 1).index_select(0, slots).view(self.dtype)
        return dequantize(values, self.head_scales(cache)[plane_kv][self.slot_index(slots)], dtype)

    def copy_slots(self, cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Values and scales of `src_slots: [N]` to `dst_slots: [N]`, K and V."""
        values, scales = self.value_bytes(cache).flatten(1, 2), self.head_scales(cache)
        src, dst = self.slot_index(src_slots), self.slot_index(dst_slots)
        for half in (0, 1):
            values[half][dst_slots] = values[half][src_slots]
            scales[half][dst] = scales[half][src]

    def block_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Values `[2, NB, bs, KVH, D]` and scales `[2, NB, KVH, bs]`: what a block holds (swap)."""
        return self.value_bytes(cache), self.head_scales(cache)

    def slot_index(self, slots: torch.Tensor) -> tuple[torch.Tensor, slice, torch.Tensor]:
        """Index of `slots: [N]` into one half's `[NB, KVH, bs]` scales (`[N, KVH]` when indexed)."""
        slots = slots.long()
        return slots // self.block_size, slice(None), slots % self.block_size
