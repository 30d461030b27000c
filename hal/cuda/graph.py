"""`Graph` over `torch.cuda.CUDAGraph` (a hipGraph on ROCm), captured into the Hal's shared pool."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from hal.common.graph import cycle_collector_paused


class CudaGraph:
    """One captured graph. All graphs of a Hal capture on the same side stream; `pool` is a memory
    pool to share with other graphs, or None for a private one (what `CudaHal.graph()` gives).

    Warm-up is the caller's job: run `fn()` once eagerly before `capture(fn)`, so that lazy
    initialisation (cuBLAS workspaces, Triton compilation and autotuning, allocator growth)
    happens outside capture, where it is allowed. `capture` does not run `fn` eagerly itself:
    the caller knows whether its function has side effects (KV writes) that must not happen twice.

    Graphs sharing a pool must never replay concurrently, and a graph's outputs are then only
    valid until another graph of the pool replays.
    `update(host_params)` is a no-op: our kernels read lengths from device buffers.
    """

    def __init__(self, device: torch.device, pool: Any, stream: Any) -> None:
        self.device, self.pool, self.stream = device, pool, stream
        self.graph = torch.cuda.CUDAGraph()
        self.fn: Callable[[], Any] | None = None
        self.outputs: Any = None
        self.is_captured = False

    def capture(self, fn: Callable[[], Any]) -> Any:
        if self.is_captured:
            raise RuntimeError("this graph is already captured; make a new one with hal.graph()")
        with torch.cuda.device(self.device):
            # torch.cuda.graph synchronises the device first, so work queued before capture is done
            with cycle_collector_paused(), torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
                self.outputs = fn()
        # the graph reads every tensor `fn` closes over at fixed addresses: keeping `fn` keeps them
        # allocated (a freed static input is reused by the allocator and replays read garbage)
        self.fn = fn
        self.is_captured = True
        return self.outputs

    def replay(self) -> None:
        if not self.is_captured:
            raise RuntimeError("replay before capture")
        self.graph.replay()

    def update(self, host_params: Sequence[dict[str, Any]]) -> None:
        pass

    def reset(self) -> None:
        """Free the captured graph (its pool memory returns to the shared pool)."""
        self.graph.reset()
        self.fn, self.outputs, self.is_captured = None, None, False
