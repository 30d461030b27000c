"""Swap preemption's copies: a preempted request's KV blocks to host memory and back.

The scheduler decides (runtime/scheduler.py: `BlockCopy` lists in its output); the engine calls
`swap_out` / `swap_in` before it launches the step that reuses the freed blocks. Both copies are
issued on the current stream, so they stay ordered with the steps around them: the blocks are
read after the last step that wrote them and written before the first step that reads them, with
no host sync. Host memory comes from the Hal (`Hal.host_tensor`: page-locked on accelerators).
"""
from __future__ import annotations

from typing import Sequence

import torch

from hal.base import AttentionBackend, Hal


def block_slots(blocks: Sequence[int], block_size: int, device: torch.device) -> torch.Tensor:
    """Cache slots `[len(blocks) * block_size]` of the given blocks, block after block."""
    starts = torch.tensor(list(blocks), dtype=torch.long) * block_size
    return (starts[:, None] + torch.arange(block_size)).flatten().to(device)


class SwapSpace:
    """Host copies of swapped-out requests' blocks, one tensor `[layers, 2, slots, KVH, D]` each."""

    def __init__(self, hal: Hal, backend: AttentionBackend, kv_caches: Sequence[torch.Tensor]) -> None:
        self.hal, self.backend, self.kv_caches = hal, backend, kv_caches
        self.host: dict[str, torch.Tensor] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.host

    def swap_out(self, request_id: str, blocks: Sequence[int]) -> None:
        """Copy `blocks` (every layer slot) to host memory kept under `request_id`."""
        slots = block_slots(blocks, self.backend.block_size, self.kv_caches[0].device)
        views = [self.backend.slot_view(cache) for cache in self.kv_caches]
        host = self.hal.host_tensor((len(views), 2, slots.shape[0], *views[0].shape[2:]), views[0].dtype)
        for layer, view in enumerate(views):
            host[layer].copy_(view[:, slots], non_blocking=True)        # [2, S, KVH, D]
        self.host[request_id] = host

    def swap_in(self, request_id: str, blocks: Sequence[int]) -> None:
        """Copy the request's host blocks into `blocks` (same count and order as swapped out)."""
        host = self.host.pop(request_id)
        device = self.kv_caches[0].device
        slots = block_slots(blocks, self.backend.block_size, device)
        assert slots.shape[0] == host.shape[2], "swap-in needs as many blocks as were swapped out"
        for layer, cache in enumerate(self.kv_caches):
            self.backend.slot_view(cache)[:, slots] = host[layer].to(device, non_blocking=True)

    def drop(self, request_id: str) -> None:
        self.host.pop(request_id, None)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())
