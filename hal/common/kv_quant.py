"""8-bit KV cache: the quantization every backend shares, and the cache layout.

Scales: one scale per (token, KV head), computed when the token's K or V is written from
`absmax(x[token, head, :]) / QMAX`; `q = clamp(x / scale, -QMAX, QMAX)` rounded to the 8-bit format
(round-to-nearest-even; int8 rounds to the nearest integer), and `x ~ q * scale` on load.
- FP8 formats: the scale is the power of two at or above `absmax / QMAX`, stored as its exponent byte
  (E8M0, as OCP's microscaling formats store theirs: `2^(byte - 127)`). FP8 keeps 3 mantissa bits at
  every exponent, so a power-of-two scale loses little: the largest value lands in [QMAX/2, QMAX],
  rounded, where the exact scale put it on QMAX, and small values sit a binade nearer the
  subnormals (FP8 KV's mean logit error grew 2.5% at Ouro-1.4B's layer shape, 15-28% on the sharp
  golden models: docs/fp8.md). Dividing and multiplying by it is exact, and it costs 1 byte per
  (token, head) next to `head_dim` bytes of values where a float32 took 4 (H200, FP8 decode reads 2%
  fewer bytes: docs/performance.md, lever 75).
- int8 (Ascend): the float32 scale `absmax / 127` itself (a uniform grid would lose up to a bit to a
  power of two), 4 bytes.
Why per token: a slot's scale depends on that token's values only, so it is fixed the moment the
slot is written and never changes, which makes everything that moves or shares KV exact with no
extra rule: prefix-cache blocks shared between requests, blocks swapped to host and back, the
last_exited copy into deeper planes, speculation's overwrite on rollback, chunked prefill (a
chunk's quantization does not depend on where the chunk boundary fell), graph padding rows. There is
no calibration pass, no running statistic, no host sync: the scale is computed on the device inside
the KV write, so the write stays capturable in graphs. What is quantized is what the pass computed,
though: a pass of another shape (a prompt padded to its bucket, other chunks) may compute a value a
float32 rounding apart, and rounding to 8 bits can widen that to a whole step (docs/fp8.md, "Exactness").

Layout (`QuantLayout`; the CPU reference and the Triton kernels; Ascend's fused op takes it slot-major):
one uint8 tensor per layer `[2, num_blocks * block_bytes]` (each half rounded up to 16 bytes), K then
V; each half holds the values of every block, then the scales of every block `[NB, KVH, block_size]`
(exponent bytes or float32). The values lie
head-major within a block, `[NB, KVH, block_size, D]`, or slot-major `[NB, block_size, KVH, D]` as a
16-bit cache holds them (`heads_outer=False`: what Ascend's fused op and KV scatter take); views
index both as `[NB, block_size, KVH, D]` through strides, which is all the kernels read. Why
head-major: a decode kernel reads one KV head's keys a tile at a time, and a tile is then one
contiguous run of values (16 keys: 2 KiB at D = 128) and one of scales (16 bytes), where
slot-major puts each key's 128 bytes 2 KiB apart (H200, FP8 row kernel at 128 x 1K:
docs/performance.md, levers 70 and 74). A slot's bytes are therefore pieces apart: `copy_slots`,
`read_slots` and `block_views` (swap) move all of them.
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


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """How a cache of 8-bit `dtype` stores its scales: exponent bytes (FP8) or float32 (int8)."""
    quant_max(dtype)
    return torch.uint8 if dtype.is_floating_point else torch.float32


def power_of_two_at_least(s: torch.Tensor) -> torch.Tensor:
    """The least power of two >= `s` (float32, s >= 0; 1 where s is 0), by its bits: exactly what the
    Triton writers compute (hal/kernels/kv_write.py `_scale_of`)."""
    bits = s.view(torch.int32)
    exponent = ((bits >> 23) + ((bits & 0x7FFFFF) != 0).to(torch.int32)).clamp(max=254)
    exponent = torch.where(s > 0, exponent, torch.full_like(exponent, 127))
    return (exponent << 23).view(torch.float32)


def encode_scales(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scales `quantize` returned, as a cache of `dtype` stores them (`scale_dtype`)."""
    if scale_dtype(dtype) == torch.uint8:
        return (scale.view(torch.int32) >> 23).to(torch.uint8)
    return scale


def decode_scales(stored: torch.Tensor) -> torch.Tensor:
    """Stored scales (exponent bytes or float32) -> float32."""
    if stored.dtype == torch.uint8:
        return (stored.to(torch.int32) << 23).view(torch.float32)
    return stored


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: [..., D]` -> (`q: [..., D]` in `dtype`, `scale: [...]` float32), one scale per vector."""
    qmax = quant_max(dtype)
    x32 = x.float()
    scale = x32.abs().amax(-1) / qmax
    if scale_dtype(dtype) == torch.uint8:
        scale = power_of_two_at_least(scale)
    else:
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
    block, head-major `[NB, KVH, block_size, D]` (or slot-major `[NB, block_size, KVH, D]` with
    `heads_outer=False`), then the scales of every block `[NB, KVH, block_size]` (`scale_dtype`)."""

    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype              # the 8-bit format of the values
    heads_outer: bool = True        # values head-major within a block (False: slot-major, Ascend's)

    @property
    def scale_dtype(self) -> torch.dtype:
        return scale_dtype(self.dtype)

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot takes in one half: its values and its scales."""
        return self.num_kv_heads * (self.head_dim + self.scale_dtype.itemsize)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.slot_bytes

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """`(2, half)`: each half (a row) rounded up to 16 bytes, so that V starts aligned as K does."""
        if (self.block_size * self.num_kv_heads * self.head_dim) % 16:
            # the scales then start on a 16-byte boundary too
            raise ValueError(f"a quantized cache needs block_size * num_kv_heads * head_dim to be a multiple "
                             f"of 16 (aligned regions for vector loads), got block_size {self.block_size}, "
                             f"{self.num_kv_heads} KV heads of {self.head_dim}; a block_size that is a "
                             f"multiple of 16 always fits")
        return (2, -(-num_blocks * self.block_bytes // 16) * 16)

    def num_blocks(self, cache: torch.Tensor) -> int:
        return cache.shape[1] // self.block_bytes

    def _values_end(self, cache: torch.Tensor) -> tuple[int, int]:
        """(blocks, where each half's values end and its scales begin, in bytes)."""
        num_blocks = self.num_blocks(cache)
        return num_blocks, num_blocks * self.block_size * self.num_kv_heads * self.head_dim

    def _stored_values(self, cache: torch.Tensor) -> torch.Tensor:
        """The values in memory order: `[2, NB, KVH, bs, D]` head-major, `[2, NB, bs, KVH, D]` slot-major."""
        num_blocks, end = self._values_end(cache)
        inner = (self.num_kv_heads, self.block_size) if self.heads_outer else (self.block_size, self.num_kv_heads)
        return cache[:, :end].view(2, num_blocks, *inner, self.head_dim)

    def value_bytes(self, cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, bs, KVH, D]` uint8, a view of `cache` (strided when head-major; torch's indexing
        ops take bytes where they take no float8)."""
        values = self._stored_values(cache)
        return values.transpose(2, 3) if self.heads_outer else values

    def values(self, cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, bs, KVH, D]` in `dtype`, a view of `cache`."""
        return self.value_bytes(cache).view(self.dtype)

    def head_scales(self, cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, KVH, bs]` as stored (`scale_dtype`: exponent bytes or float32; each half's part
        contiguous), a view of `cache`."""
        num_blocks, start = self._values_end(cache)
        end = start + num_blocks * self.block_size * self.num_kv_heads * self.scale_dtype.itemsize
        return cache[:, start:end].view(self.scale_dtype).view(2, num_blocks, self.num_kv_heads, self.block_size)

    def scales(self, cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, bs, KVH]` as stored, indexed as the values are (a strided view; kernels take its strides)."""
        return self.head_scales(cache).transpose(2, 3)

    def write(self, cache: torch.Tensor, plane_kv: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize `x: [T, KVH, D]` into slots `slots: [T]` of K (`plane_kv=0`) or V (1), in place."""
        q, scale = quantize(x, self.dtype)
        at = self.slot_index(slots)
        self.value_bytes(cache)[plane_kv][at[0], at[2]] = q.view(torch.uint8)
        self.head_scales(cache)[plane_kv][at] = encode_scales(scale, self.dtype)

    def read_blocks(self, cache: torch.Tensor, plane_kv: int, blocks: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized K (0) or V (1) of `blocks: [N]`, `[N, bs, KVH, D]`."""
        values = self.value_bytes(cache)[plane_kv].index_select(0, blocks).view(self.dtype)
        return dequantize(values, decode_scales(self.scales(cache)[plane_kv].index_select(0, blocks)), dtype)

    def read_slots(self, cache: torch.Tensor, plane_kv: int, slots: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized K (0) or V (1) `[N, KVH, D]` stored at `slots: [N]`."""
        at = self.slot_index(slots)
        values = self.value_bytes(cache)[plane_kv][at[0], at[2]].view(self.dtype)
        return dequantize(values, decode_scales(self.head_scales(cache)[plane_kv][at]), dtype)

    def copy_slots(self, cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Values and scales of `src_slots: [N]` to `dst_slots: [N]`, K and V."""
        values, scales = self.value_bytes(cache), self.head_scales(cache)
        src, dst = self.slot_index(src_slots), self.slot_index(dst_slots)
        for half in (0, 1):
            values[half][dst[0], dst[2]] = values[half][src[0], src[2]]
            scales[half][dst] = scales[half][src]

    def block_views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Values `[2, NB, KVH, bs, D]` (slot-major: `[2, NB, bs, KVH, D]`) and scales `[2, NB, KVH, bs]`
        as stored, in memory order: what a block holds (swap)."""
        return self._stored_values(cache), self.head_scales(cache)

    def slot_index(self, slots: torch.Tensor) -> tuple[torch.Tensor, slice, torch.Tensor]:
        """Index of `slots: [N]` into one half's `[NB, KVH, bs]` scales (`[N, KVH]` when indexed)."""
        slots = slots.long()
        return slots // self.block_size, slice(None), slots % self.block_size
