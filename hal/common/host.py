"""The device side of a Hal that runs on the host: one device, streams and events that are correct
no-ops (work on the host is issued in program order), host memory for the memory queries. The CPU
Hal and the simulated Ascend Hal share it."""
from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from hal.base import MemInfo


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """Bytes Linux could hand out now without swapping (`MemAvailable`): free pages plus the page cache
    and other memory it can reclaim. Free pages alone (`SC_AVPHYS_PAGES`) leave the page cache out, so
    a machine that has read a few checkpoints looks full. None where the file or the line is missing."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024          # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        pass
    return None


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
            page_size = os.sysconf("SC_PAGE_SIZE")
            total = os.sysconf("SC_PHYS_PAGES") * page_size
            free = available_memory() or os.sysconf("SC_AVPHYS_PAGES") * page_size
            return MemInfo(free, total)
        except (ValueError, OSError, AttributeError):
            return MemInfo(8 << 30, 16 << 30)

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Pages the kernel zeroes as each is first touched (numpy takes a large zeroed array by calloc,
        which maps them untouched), where `torch.zeros` writes every byte at once: a KV pool of many GiB
        then costs no time at start (torch.zeros: about 0.7 s a GiB) and no memory its requests never
        reach."""
        num_bytes = math.prod(shape) * dtype.itemsize
        return torch.from_numpy(np.zeros(num_bytes, dtype=np.uint8)).view(dtype).view(tuple(shape))

    def memory_stats(self) -> dict[str, int]:
        return {"allocated": 0, "reserved": 0, "peak_allocated": 0}

    def reset_peak_memory(self) -> None:
        pass

    def empty_cache(self) -> None:
        pass
