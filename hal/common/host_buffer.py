"""The staged host buffer: `hal.resources.HostBuffer` where the device cannot read host memory directly
(Ascend, CUDA/ROCm without UVA, the simulations).

Host rows (pinned where the device is not the host) are copied into a device tensor at a fixed
address: `device_view()` enqueues one asynchronous copy of the rows marked dirty since the last
call. The device reads them when the work that uses them runs, so the caller must not overwrite
rows that queued work still needs (double-buffer, or wait on an event).
"""
from __future__ import annotations

from typing import Sequence

import torch


def dirty_rows(lo: int, hi: int | None, num_rows: int) -> tuple[int, int]:
    hi = num_rows if hi is None else hi
    if not 0 <= lo <= hi <= num_rows:
        raise IndexError(f"mark_dirty({lo}, {hi}) is outside rows [0, {num_rows}]")
    return lo, hi


def check_shape(shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(s) for s in shape)
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f"host_buffer shape {shape} must have at least one dimension and no empty ones")
    return shape


class StagedHostBuffer:
    """Pinned host rows copied into a fixed device tensor: only the rows marked dirty, once,
    asynchronously on the current stream when `device_view()` is called. `pin=None` pins where
    the device is not the host."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                 pin: bool | None = None) -> None:
        shape = check_shape(shape)
        self.is_pinned = device.type != "cpu" if pin is None else pin
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=self.is_pinned)       # [rows, ...]
        self._device = torch.zeros(shape, dtype=dtype, device=device)
        self._dirty = (0, 0)                     # rows [lo, hi) written since the last copy

    def mark_dirty(self, lo: int = 0, hi: int | None = None) -> None:
        lo, hi = dirty_rows(lo, hi, self.host.shape[0])
        if hi == lo:
            return
        old_lo, old_hi = self._dirty
        self._dirty = (lo, hi) if old_lo == old_hi else (min(lo, old_lo), max(hi, old_hi))

    def device_view(self) -> torch.Tensor:
        lo, hi = self._dirty
        if hi > lo:
            self._device[lo:hi].copy_(self.host[lo:hi], non_blocking=self.is_pinned)
            self._dirty = (0, 0)
        return self._device
