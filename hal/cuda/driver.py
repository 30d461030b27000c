"""The few CUDA runtime calls torch does not expose: the device address of mapped pinned memory.

`cuda.bindings.runtime` (NVIDIA's cuda-python) first, else ctypes on the libcudart that torch
already loaded, so the call lands in the same runtime and primary context as torch's own.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any


def loaded_library(stem: str) -> str | None:
    """Path of a shared library whose file name starts with `stem` and that this process has
    already mapped (e.g. torch's bundled libcudart / libamdhip64), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.rsplit(" ", 1)[-1]
        if path.startswith("/") and Path(path).name.startswith(stem):
            return path
    return None


def open_library(stem: str, fallbacks: tuple[str, ...]) -> ctypes.CDLL:
    """The already-loaded copy of a vendor library, else the first of `fallbacks` that loads."""
    candidates = [p for p in (loaded_library(stem),) if p] + list(fallbacks)
    errors = []
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise OSError(f"cannot load {stem}: " + "; ".join(errors or ["no candidates"]))


def device_pointer_via_ctypes(lib: Any, symbol: str, host_ptr: int) -> int:
    """Call `err = symbol(void **dev, void *host, unsigned flags)` (the CUDA and HIP spelling
    are the same) and return the device address."""
    dev = ctypes.c_void_p()
    err = getattr(lib, symbol)(ctypes.byref(dev), ctypes.c_void_p(host_ptr), ctypes.c_uint(0))
    if int(err) != 0:
        raise OSError(f"{symbol}(0x{host_ptr:x}) failed with error {int(err)}: the memory is not "
                      f"mapped pinned host memory on this device")
    if not dev.value:
        raise OSError(f"{symbol}(0x{host_ptr:x}) returned a null device address")
    return int(dev.value)


@functools.lru_cache(maxsize=None)
def _runtime() -> Any:
    """cuda-python's runtime module (new and old import paths), or None."""
    try:
        from cuda.bindings import runtime
        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart  # cuda-python < 12.6
        return cudart
    except ImportError:
        return None


@functools.lru_cache(maxsize=None)
def _libcudart() -> ctypes.CDLL:
    names = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")
    return open_library("libcudart", names)


def cuda_host_device_pointer(host_ptr: int) -> int:
    """`cudaHostGetDevicePointer`: the device address of pinned host memory at `host_ptr`."""
    runtime = _runtime()
    if runtime is not None:
        err, dev = runtime.cudaHostGetDevicePointer(host_ptr, 0)
        if _code(err) != 0:
            raise OSError(f"cudaHostGetDevicePointer(0x{host_ptr:x}) failed: {err}")
        return int(dev)
    return device_pointer_via_ctypes(_libcudart(), "cudaHostGetDevicePointer", host_ptr)


def cuda_pointer_kind(ptr: int) -> str | None:
    """The memory kind at `ptr`: host, device, managed or unregistered (cudaPointerGetAttributes), or
    None without cuda-python. Tests use it to prove a device view is host memory, not a copy."""
    runtime = _runtime()
    if runtime is None:
        return None
    err, attrs = runtime.cudaPointerGetAttributes(ptr)
    if _code(err) != 0:
        raise OSError(f"cudaPointerGetAttributes(0x{ptr:x}) failed: {err}")
    return {0: "unregistered", 1: "host", 2: "device", 3: "managed"}.get(_code(attrs.type), str(attrs.type))


def _code(value: Any) -> int:
    """An int from a cuda-python enum (IntEnum in older releases, an int subclass in newer)."""
    return int(getattr(value, "value", value))
