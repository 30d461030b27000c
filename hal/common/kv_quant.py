"""8-bit KV cache: the quantization every backend shares, and the per-slot row layout.

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

Layout (the CPU reference and the Triton kernels; Ascend has its own, see hal/ascend/attention.py):
one cache tensor per layer of raw bytes `[2, num_blocks, block_size, row_bytes]` (uint8), K then V;
a slot's row is its `KVH * D` values, then `KVH` float32 scales, padded to 16 bytes so every row
starts on a 16-byte boundary (vector loads). A slot is one contiguous row: `slot_view`, `copy_kv`
and swap move values and scales together.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

QUANT_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0, torch.int8: 127.0}
KV_DTYPE_NAMES = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e4m3fnuz": torch.float8_e4m3fnuz, "int8": torch.int8}
ROW_ALIGN = 16                      # bytes


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


class RowLayout(NamedTuple):
    """Byte rows of one quantized slot: `KVH * D` values, `KVH` float32 scales, padding."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype              # the 8-bit format of the values

    @property
    def row_bytes(self) -> int:
        used = self.num_kv_heads * self.head_dim + 4 * self.num_kv_heads
        return -(-used // ROW_ALIGN) * ROW_ALIGN

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.row_bytes)

    def value_bytes(self, cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, bs, KVH, D]` uint8, a strided view of `cache: [2, NB, bs, row_bytes]` (torch's
        indexing ops take bytes where they take no float8)."""
        width = self.num_kv_heads * self.head_dim
        return cache[..., :width].unflatten(-1, (self.num_kv_heads, self.head_dim))

    def values(self, cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, bs, KVH, D]` in `dtype`, a strided view of `cache`."""
        return self.value_bytes(cache).view(self.dtype)

    def scales(self, cache: torch.Tensor) -> torch.Tensor:
        """`[2, NB, bs, KVH]` float32, a strided view of `cache`."""
        start = self.num_kv_heads * self.head_dim
        return cache[..., start:start + 4 * self.num_kv_heads].view(torch.float32)

    def write(self, cache: torch.Tensor, plane_kv: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize `x: [T, KVH, D]` into slots `slots: [T]` of K (`plane_kv=0`) or V (1), in place."""
        q, scale = quantize(x, self.dtype)
        self.value_bytes(cache)[plane_kv].flatten(0, 1).index_copy_(0, slots, q.view(torch.uint8))
        self.scales(cache)[plane_kv].flatten(0, 1).index_copy_(0, slots, scale)

    def read_blocks(self, cache: torch.Tensor, plane_kv: int, blocks: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized K (0) or V (1) of `blocks: [N]`, `[N, bs, KVH, D]`."""
        values = self.value_bytes(cache)[plane_kv].index_select(0, blocks).view(self.dtype)
        return dequantize(values, self.scales(cache)[plane_kv].index_select(0, blocks), dtype)

    def read_slots(self, cache: torch.Tensor, plane_kv: int, slots: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized K (0) or V (1) `[N, KVH, D]` stored at `slots: [N]`."""
        values = self.value_bytes(cache)[plane_kv].flatten(0, 1).index_select(0, slots).view(self.dtype)
        scales = self.scales(cache)[plane_kv].flatten(0, 1).index_select(0, slots)
        return dequantize(values, scales, dtype)
