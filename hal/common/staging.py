"""Pinned host mirrors of a captured meta's device tensors, in a ring guarded by events.

`update_meta` writes a step's values on the host and queues an asynchronous copy into the
meta's fixed device tensors. The copy reads the pinned memory when the stream reaches it, which
can be several steps after the host moved on (draft passes and async rounds never sync), so a
host write into a mirror whose copy is still queued would change the values that step reads.
Each slot of the ring therefore remembers the event recorded after its copies, and the host
waits on it before writing that slot again: with `depth` slots the host stalls only when that
many copies are still queued.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

DEFAULT_DEPTH = 4


class StagingRing:
    def __init__(self, arrays: Sequence[np.ndarray], device: torch.device, depth: int = DEFAULT_DEPTH,
                 make_event: Callable[[], object] | None = None) -> None:
        self.is_cpu = device.type == "cpu"
        self.slots = [[torch.from_numpy(a).clone() if self.is_cpu else torch.from_numpy(a).pin_memory()
                       for a in arrays] for _ in range(depth)]
        # the CPU runs copies at once: nothing is ever in flight there
        self._make_event = make_event or (None if self.is_cpu else (lambda: torch.Event(device=device)))
        self._events: list[object | None] = [None] * depth
        self._next = 0
        self._landing: dict[int, torch.Tensor] = {}   # per target: contiguous device memory for narrower arrays

    def stage(self, arrays: Sequence[np.ndarray], targets: Sequence[torch.Tensor], narrow: Sequence[int] = ()) -> None:
        """Queue copies of `arrays` into `targets` (same shapes) on the current stream. The arrays at
        the indices `narrow` may be narrower than their targets in the last dimension (block tables of
        sequences shorter than the capacity's max_model_len): only their columns travel, into the
        targets' first ones, and the others keep older values, which no kernel reads (kernels stop
        at each sequence's length)."""
        slot = self._next
        self._next = (slot + 1) % len(self.slots)
        if self._events[slot] is not None:
            self._events[slot].synchronize()          # that slot's earlier copy has been read
        previous = self._events[slot - 1]
        for index, (host, device, array) in enumerate(zip(self.slots[slot], targets, arrays)):
            if array.shape == tuple(device.shape):
                host.copy_(torch.from_numpy(array))
                device.copy_(host, non_blocking=True)
            elif index in narrow and array.shape[:-1] == tuple(device.shape[:-1]) and array.shape[-1] < device.shape[-1]:
                self._stage_columns(index, host, device, array, previous)
            else:
                raise ValueError(f"batch shape {array.shape} does not fit the captured meta {tuple(device.shape)}")
        if self._make_event is not None:
            event = self._make_event()
            event.record()
            self._events[slot] = event

    def _stage_columns(self, index: int, host: torch.Tensor, device: torch.Tensor, array: np.ndarray,
                       previous: object | None) -> None:
        """`array`'s columns into the first ones of `device`: through a contiguous prefix of the pinned
        mirror and of a device landing buffer (a strided copy between host and device would go
        through pageable memory, which can wait for the stream), then spread on the device."""
        columns, size = device[..., :array.shape[-1]], array.size
        flat = host.view(-1)[:size]
        flat.copy_(torch.from_numpy(np.ascontiguousarray(array)).view(-1))
        if self.is_cpu:
            columns.copy_(flat.view(array.shape))
            return
        landing = self._landing.get(index)
        if landing is None or landing.numel() < size:    # grown to the widest batch so far, not the capacity
            grown = min(device.numel(), max(size, 2 * (0 if landing is None else landing.numel())))
            landing = self._landing[index] = torch.empty(grown, dtype=device.dtype, device=device.device)
        if previous is not None:
            previous.wait()           # the last stage's spread out of the landing buffer runs first, whatever its stream
        landing[:size].copy_(flat, non_blocking=True)
        columns.copy_(landing[:size].view(array.shape))
