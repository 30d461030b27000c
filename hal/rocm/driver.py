"""`hipHostGetDevicePointer` through ctypes on libamdhip64 (the copy torch loaded, if any)."""
from __future__ import annotations

import ctypes
import functools
from typing import Any

from hal.cuda.driver import device_pointer_via_ctypes, open_library


@functools.lru_cache(maxsize=None)
def _libamdhip64() -> ctypes.CDLL:
    return open_library("libamdhip64", ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"))


def hip_host_device_pointer(host_ptr: int, lib: Any = None) -> int:
    """The device address of pinned host memory at `host_ptr`; raises OSError when HIP refuses."""
    lib = lib if lib is not None else _libamdhip64()
    return device_pointer_via_ctypes(lib, "hipHostGetDevicePointer", host_ptr)
