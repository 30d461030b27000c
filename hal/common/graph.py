"""The eager graph: `hal.resources.Graph` for Hals that do not record device work (the CPU, simulations),
and what every recording graph needs during its capture."""
from __future__ import annotations

import contextlib
import gc
import threading
from typing import Any, Callable, Iterator, Sequence

import torch


class EagerGraph:
    """Replays by re-running the captured function and copying into the first outputs, so code
    written for device graphs (static outputs updated in place) runs unchanged."""

    def __init__(self) -> None:
        self.fn: Callable[[], Any] | None = None
        self.outputs: Any = None

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn = fn
        self.outputs = fn()
        return self.outputs

    def replay(self) -> None:
        if self.fn is None:
            raise RuntimeError("replay before capture")
        copy_into(self.outputs, self.fn())

    def update(self, host_params: Sequence[dict[str, Any]]) -> None:
        pass


def copy_into(dst: Any, src: Any) -> None:
    """Copy `src` into the same-structured tensors of `dst` (nested tuples, lists, dicts): a host
    graph's replay refreshes the outputs its callers hold."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            copy_into(d, s)
    elif isinstance(dst, dict):
        for key in dst:
            copy_into(dst[key], src[key])


_pause_lock = threading.Lock()    # the pause below, shared by every thread that captures
_num_pausing = 0
_was_enabled = True


@contextlib.contextmanager
def cycle_collector_paused() -> Iterator[None]:
    """No automatic cycle collection inside a capture. A collection there may free a dead cycle that
    holds another graph (an engine whose objects reference each other), and destroying a graph
    while a stream captures invalidates the capture: the next call into it fails, as "operation
    failed due to a previous error during capture" or, from cuBLAS, CUBLAS_STATUS_EXECUTION_FAILED
    (measured on an H100, docs/benchmarks.md, forty-second session). torch no longer collects
    before a capture unless `torch.compiler.config.force_cudagraph_gc` is set."""
    global _num_pausing, _was_enabled
    with _pause_lock:                # captures of several threads (tensor-parallel ranks) overlap:
        if _num_pausing == 0:        # the first pauses, the last restores what it found
            _was_enabled = gc.isenabled()
            gc.disable()
        _num_pausing += 1
    try:
        yield
    finally:
        with _pause_lock:
            _num_pausing -= 1
            if _num_pausing == 0 and _was_enabled:
                gc.enable()

