"""The device resources a Hal hands out besides attention, as protocols: `HostBuffer`
(`Hal.host_buffer`), `Graph` (`Hal.graph`) and `Comm` (`Hal.comm`).

The implementations (hal/common/host_buffer.py, graph.py and comm.py, shared by several Hals, and
the CUDA and Ascend ones) do not inherit from these: callers rely only on the members named here.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

import torch


class HostBuffer(Protocol):
    """A buffer the host writes and the device reads (step metadata: block tables, lengths).

    `host` is a CPU tensor to write into. After writing rows, call `mark_dirty(lo, hi)` and then
    `device_view()` returns a device tensor with those contents: a zero-copy alias on CUDA/ROCm
    (mapped pinned memory), an asynchronous staged copy of the dirty rows on Ascend, the same
    tensor on the CPU. The device view's address never changes, so graphs may capture it.
    """

    host: torch.Tensor

    def mark_dirty(self, lo: int = 0, hi: int | None = None) -> None: ...

    def device_view(self) -> torch.Tensor: ...


class Graph(Protocol):
    """A captured sequence of device work over static buffers.

    `capture(fn)` records `fn()` and returns its outputs: tensors that every replay overwrites in
    place (a device graph records without running, so they hold values only after a replay; call
    `fn()` once eagerly before capturing one, for lazy initialisation; the eager graph needs no such call). `replay()` re-issues the same work. `update(host_params)` pushes
    new host-side arguments into the captured work before a replay: a no-op where kernels read
    lengths from device memory (CUDA/ROCm), required on Ascend where fused attention takes lengths
    as host lists. On the CPU, replay re-runs `fn` eagerly and copies into the captured outputs.
    """

    def capture(self, fn: Callable[[], Any]) -> Any: ...

    def replay(self) -> None: ...

    def update(self, host_params: Sequence[dict[str, Any]]) -> None: ...


class Comm(Protocol):
    """Collectives over one torch.distributed process group (nccl / rccl / hccl / gloo).

    All ops are in place on `tensor`/`out` and synchronous with respect to the current stream.
    """

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor: ...

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor: ...

    def send(self, tensor: torch.Tensor, dst: int) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...

    def barrier(self) -> None: ...
