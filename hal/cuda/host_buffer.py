"""Host-written, device-readable buffers on CUDA and ROCm (see `hal.resources.HostBuffer`).

Two kinds, chosen once per Hal by `decide_uva`:
- `MappedHostBuffer`: pinned host memory whose device address (cudaHostGetDevicePointer /
  hipHostGetDevicePointer) is wrapped as a torch device tensor. Kernels read the host memory
  directly, so there is no copy at all and `mark_dirty` does nothing.
- `StagedHostBuffer` (hal/common/host_buffer.py): pinned host memory plus a device tensor at a
  fixed address; `device_view()` enqueues one asynchronous copy of the rows marked dirty.

Either way the host rows are read by the device *when the work that uses them runs*, so the
caller must not overwrite rows that queued work still needs (double-buffer, or wait on an event).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch

from hal.common.host_buffer import StagedHostBuffer, check_shape, dirty_rows  # noqa: F401 (the Hal builds buffers.StagedHostBuffer)

UVA_ENV = "LOOPSTACK_UVA"
PROBE_LEN = 256                      # int32 values the probe writes on the host and reads on the device


class UvaDecision(NamedTuple):
    is_mapped: bool                  # host buffers are zero-copy mapped (else staged copies)
    reason: str                      # logged once; shows up in the conformance output


class MappingError(RuntimeError):
    pass


class _CudaArray:
    """Just enough `__cuda_array_interface__` for `torch.as_tensor` to alias `num_bytes` bytes at a
    device address. torch keeps a reference to this object for the life of the tensor's storage,
    and this object keeps `owner` (the pinned host tensor), so the memory outlives every view."""

    def __init__(self, device_ptr: int, num_bytes: int, owner: torch.Tensor) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1", "strides": None,
                                         "data": (device_ptr, False), "version": 2}


def alias_device_memory(device_ptr: int, num_bytes: int, owner: torch.Tensor,
                        device: torch.device) -> torch.Tensor:
    """A `[num_bytes]` uint8 tensor on `device` at exactly `device_ptr` (no copy)."""
    # newer torch labels the tensor with `device`; older torch asks the driver which device owns
    # the pointer and copies if that differs: the address check below catches such a copy
    flat = torch.as_tensor(_CudaArray(device_ptr, num_bytes, owner), device=device)
    if flat.device != device or flat.data_ptr() != device_ptr:
        raise MappingError(f"mapped memory came back as {flat.device} at 0x{flat.data_ptr():x}, not {device} "
                           f"at 0x{device_ptr:x}; make host buffers after set_device(), or set {UVA_ENV}=0")
    return flat


class MappedHostBuffer:
    """Pinned host memory mapped into the device: `device_view()` is a zero-copy alias."""

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                 device_pointer: Callable[[int], int]) -> None:
        shape = check_shape(shape)
        with torch.cuda.device(device):
            torch.zeros(1, device=device)        # the primary context must exist: pinned memory is tied to it
            self.host = torch.zeros(shape, dtype=dtype, pin_memory=True)         # [rows, ...]
        num_bytes = self.host.numel() * self.host.element_size()
        self.device_ptr = device_pointer(self.host.data_ptr())
        flat = alias_device_memory(self.device_ptr, num_bytes, self.host, device)
        self._view = flat.view(dtype).view(shape)

    def mark_dirty(self, lo: int = 0, hi: int | None = None) -> None:
        dirty_rows(lo, hi, self.host.shape[0])          # nothing to copy: the device reads host memory

    def device_view(self) -> torch.Tensor:
        return self._view


def probe_mapping(make_mapped: Callable[[Sequence[int], torch.dtype], Any]) -> UvaDecision:
    """Map a small buffer, write random values on the host twice, and read them back through a
    device kernel each time without any copy. Mapping is used only when both reads match."""
    try:
        buf = make_mapped((PROBE_LEN,), torch.int32)
        view = buf.device_view()
        for attempt in (1, 2):
            values = torch.randint(-2**31, 2**31 - 1, (PROBE_LEN,), dtype=torch.int32)
            buf.host.copy_(values)
            seen = (view + 0).cpu()              # a kernel reads the mapped memory; .cpu() waits for it
            wrong = int((seen != values).sum())
            if wrong:
                return UvaDecision(False, f"probe: after host write {attempt} the device read {wrong} of "
                                          f"{PROBE_LEN} values wrong; using staged copies")
        return UvaDecision(True, "probe: a device kernel read two rounds of host writes through the mapped "
                                 f"address 0x{view.data_ptr():x}")
    except Exception as exc:  # any failure means "do not map"; the reason is logged
        return UvaDecision(False, f"probe failed ({type(exc).__name__}: {exc}); using staged copies")


def decide_uva(env_value: str | None, probe: Callable[[], UvaDecision]) -> UvaDecision:
    """`LOOPSTACK_UVA`: 0 forces staged copies, 1 forces mapping (no probe), unset/auto probes."""
    value = (env_value or "auto").strip().lower()
    if value in ("0", "false", "off", "no"):
        return UvaDecision(False, f"{UVA_ENV}={env_value}: staged copies forced")
    if value in ("1", "true", "on", "yes"):
        return UvaDecision(True, f"{UVA_ENV}={env_value}: mapping forced, probe skipped")
    if value != "auto":
        raise ValueError(f"{UVA_ENV}={env_value!r} is not understood: use 1 (map pinned host memory), "
                         f"0 (staged copies) or auto (probe; the default)")
    return probe()
