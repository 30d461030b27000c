"""Device visibility on ROCm: HIP honours both HIP_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES, and
torch's device count reads HIP's first, so the two must say the same thing before HIP starts."""
from __future__ import annotations

from typing import MutableMapping

CUDA_ENV, HIP_ENV = "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"


def _normalized(devices: str) -> str:
    return ",".join(part.strip() for part in devices.split(","))


def sync_visible_devices(environ: MutableMapping[str, str]) -> str | None:
    """Copy whichever of the two variables is set into the other (child processes inherit both).
    Raises ValueError when both are set and disagree. Returns the device list, or None if unset.

    Must run before the HIP runtime initialises to affect this process; ROCR_VISIBLE_DEVICES,
    applied below HIP, is left alone."""
    cuda, hip = environ.get(CUDA_ENV), environ.get(HIP_ENV)
    if cuda is None and hip is None:
        return None
    if cuda is None:
        environ[CUDA_ENV] = hip
    elif hip is None:
        environ[HIP_ENV] = cuda
    elif _normalized(cuda) != _normalized(hip):
        raise ValueError(f"{CUDA_ENV}={cuda!r} and {HIP_ENV}={hip!r} disagree; on ROCm both select GPUs. "
                         f"Set only one of them (it is copied to the other) or set both to the same list")
    return environ[HIP_ENV]
