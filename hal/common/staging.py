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
        is_cpu = device.type == "cpu"
        self.slots = [[torch.from_numpy(a).clone() if is_cpu else torch.from_numpy(a).pin_memory()
                       for a in arrays] for _ in range(depth)]
        # the CPU runs copies at once: nothing is ever in flight there
        self._make_event = make_event or (None if is_cpu else (lambda: torch.Event(device=device)))
        self._events: list[object | None] = [None] * depth
        self._next = 0

    def stage(self, arrays: Sequence[np.ndarray], targets: Sequence[torch.Tensor]) -> None:
        """Queue copies of `arrays` into `targets` (same shapes) on the current stream."""
        slot = self._next
        self._next = (slot + 1) % len(self.slots)
        if self._events[slot] is not None:
            self._events[slot].synchronize()          # that slot's earlier copy has been read
        for host, device, array in zip(self.slots[slot], targets, arrays):
            if array.shape != tuple(device.shape):
                raise ValueError(f"batch shape {array.shape} does not fit the captured meta {tuple(device.shape)}")
            host.copy_(torch.from_numpy(array))
            device.copy_(host, non_blocking=True)
        if self._make_event is not None:
            event = self._make_event()
            event.record()
            self._events[slot] = event
