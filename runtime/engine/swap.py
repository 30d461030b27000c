"""Swap preemption's copies: a preempted request's KV blocks to host memory and back.

The scheduler decides (runtime/engine/scheduler.py: `BlockCopy` lists in its output, defined in
runtime/engine/step_schedule.py); the engine calls `swap_out` / `swap_in` before it launches the step
that reuses the freed blocks. Both copies are issued on the current stream, so they stay ordered
with the steps around them: the blocks are read after the last step that wrote them and written
before the first step that reads them, with no host sync. Host memory comes from the Hal
(`Hal.host_tensor`: page-locked on accelerators).
"""
from __future__ import annotations

from typing import Sequence

import torch

from hal.attention import AttentionBackend
from hal.base import Hal


class SwapSpace:
    """Host copies of swapped-out requests' blocks: per request, one tensor per block view of the
    backend (`AttentionBackend.block_views`: the values, and a quantized cache's scales where they
    live apart), each `[layers, 2, blocks, ...]`."""

    def __init__(self, hal: Hal, backend: AttentionBackend, kv_caches: Sequence[torch.Tensor]) -> None:
        self.hal, self.backend, self.kv_caches = hal, backend, kv_caches
        self.host: dict[str, list[torch.Tensor]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.host

    def swap_out(self, request_id: str, blocks: Sequence[int]) -> None:
        """Copy `blocks` (every layer slot) to host memory kept under `request_id`."""
        index = torch.tensor(list(blocks), dtype=torch.long, device=self.kv_caches[0].device)
        per_layer = [self.backend.block_views(cache) for cache in self.kv_caches]
        host = [self.hal.host_tensor((len(per_layer), 2, len(blocks), *view.shape[2:]), view.dtype)
                for view in per_layer[0]]
        for layer, views in enumerate(per_layer):
            for stored, view in zip(host, views):
                stored[layer].copy_(view[:, index], non_blocking=True)        # [2, B, ...]
        self.host[request_id] = host

    def swap_in(self, request_id: str, blocks: Sequence[int]) -> None:
        """Copy the request's host blocks into `blocks` (same count and order as swapped out)."""
        host = self.host.pop(request_id)
        device = self.kv_caches[0].device
        assert len(blocks) == host[0].shape[2], "swap-in needs as many blocks as were swapped out"
        index = torch.tensor(list(blocks), dtype=torch.long, device=device)
        for layer, cache in enumerate(self.kv_caches):
            for stored, view in zip(host, self.backend.block_views(cache)):
                view[:, index] = stored[layer].to(device, non_blocking=True)

    def drop(self, request_id: str) -> None:
        self.host.pop(request_id, None)

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for tensors in self.host.values() for t in tensors)
