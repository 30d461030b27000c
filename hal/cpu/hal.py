"""CPU Hal: streams, events and graphs as correct no-ops or eager replays; comm over gloo."""
from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Iterator, Sequence

import torch

from hal.base import AttentionBackend, Caps, Hal, MemInfo
from hal.cpu.attention import TorchPagedAttention

log = logging.getLogger(__name__)


class CpuStream:
    """Work on the CPU is issued in program order, so a stream is only a name."""

    def synchronize(self) -> None:
        pass

    def wait_event(self, event: "CpuEvent") -> None:
        pass

    def wait_stream(self, stream: "CpuStream") -> None:
        pass

    def __enter__(self) -> "CpuStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class CpuEvent:
    """Recorded work is already done when `record` returns; timing uses the host clock."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.time_ns: int | None = None

    def record(self, stream: CpuStream | None = None) -> None:
        import time

        self.time_ns = time.perf_counter_ns()

    def wait(self, stream: CpuStream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "CpuEvent") -> float:
        if not (self.enable_timing and self.time_ns is not None and end.time_ns is not None):
            raise RuntimeError("elapsed_time needs two recorded events created with enable_timing=True")
        return (end.time_ns - self.time_ns) / 1e6


class CpuHostBuffer:
    """Host and device are the same memory."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        self.host = torch.zeros(tuple(shape), dtype=dtype)

    def mark_dirty(self, lo: int = 0, hi: int | None = None) -> None:
        pass

    def device_view(self) -> torch.Tensor:
        return self.host


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


class HostDevice:
    """The device side of a Hal that runs on the host (the CPU reference, the simulated Ascend Hal):
    one device, streams and events that are no-ops, host memory for the memory queries."""

    device_label = "CPU Hal"

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, index: int) -> None:
        if index != 0:
            raise ValueError(f"the {self.device_label} has one device (0), not {index}")

    def stream(self, priority: int = 0) -> CpuStream:
        return CpuStream()

    def current_stream(self) -> CpuStream:
        return CpuStream()

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        yield

    def event(self, enable_timing: bool = False) -> CpuEvent:
        return CpuEvent(enable_timing)

    def synchronize(self) -> None:
        pass

    def mem_info(self) -> MemInfo:
        try:
            pages, page_size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            total = os.sysconf("SC_PHYS_PAGES") * page_size
            return MemInfo(pages * page_size, total)
        except (ValueError, OSError, AttributeError):
            return MemInfo(8 << 30, 16 << 30)

    def memory_stats(self) -> dict[str, int]:
        return {"allocated": 0, "reserved": 0, "peak_allocated": 0}

    def reset_peak_memory(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass


class CpuHal(HostDevice, Hal):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None

    @classmethod
    def is_available(cls) -> bool:
        return True

    @property
    def caps(self) -> Caps:
        return Caps(arch="cpu", warp_size=None, num_compute_units=torch.get_num_threads(), graphs=False,
                    graph_needs_host_update=False, uva=True, attention_backends=("torch",),
                    kv_block_sizes=(16,), head_dims=None, fp8_dtype=torch.float8_e4m3fn,
                    kv_quant_dtypes=(torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.int8))

    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> CpuHostBuffer:
        return CpuHostBuffer(shape, dtype)

    def graph(self) -> EagerGraph:
        return EagerGraph()

    def attention(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  block_size: int | None = None, backend: str | None = None,
                  kv_dtype: torch.dtype | None = None) -> AttentionBackend:
        requested = backend or self.attention_backend_name
        if requested not in ("auto", "torch"):
            raise ValueError(f"the CPU Hal has attention backend 'torch' only, not {requested!r}")
        return TorchPagedAttention(num_heads, num_kv_heads, head_dim, dtype, self.device(),
                                   block_size or self.caps.kv_block_sizes[0], kv_dtype=kv_dtype)
