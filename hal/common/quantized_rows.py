"""Activations quantized per row for an FP8 product (W8A8): what a kernel that ends where a projection
begins (a norm boundary) hands that projection in place of the bf16 rows, so the product's own
quantization launch goes (docs/performance.md, lever 132).

    rows = QuantizedRows(data, scale, torch.bfloat16)     # data [..., K] FP8, scale [..., 1] float32
    x ~ data * scale                                      # the rows the product would have quantized

The bytes are those `quantize_rows` makes of the bf16 rows (`scale = max(absmax, 1e-12) / QMAX`, both
divisions correctly rounded), so a product of them equals the product of the bf16 rows through the
quantizing path, bit for bit where the kernel that made them computed those rows bit for bit (on an H100
Ouro's boundaries did; Huginn's summed a row statistic in another order: docs/performance.md, lever 132).
Only a Hal whose FP8 product quantizes its activations makes them.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from hal.common.kv_quant import dequantize


class QuantizedRows(NamedTuple):
    data: torch.Tensor              # [..., K] FP8
    scale: torch.Tensor             # [..., 1] float32, one per row
    dtype: torch.dtype              # the rows' dtype before quantization: the product's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def flat(self) -> "QuantizedRows":
        """The same rows as `[M, K]` and `[M, 1]`."""
        data = self.data.reshape(-1, self.data.shape[-1])
        return QuantizedRows(data, self.scale.reshape(-1, 1), self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The rows in their dtype again (for a product that cannot take them quantized)."""
        return dequantize(self.data, self.scale[..., 0], self.dtype)
