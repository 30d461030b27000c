"""Programmatic dependent launch (PDL, sm_90+): a kernel may start while the kernel before it drains.

Why: at batch 1 a decode step is a chain of about 700 small launches, and inside a CUDA graph each
still pays its own ramp (the first bytes from HBM) and tail (the last programs, a split-K sum).
With PDL a kernel tells the next one to launch as soon as all of its programs run
(`griddepcontrol.launch_dependents`); the next one reads what never depends on its predecessor (a
projection's weights) and then waits for the predecessor to finish (`griddepcontrol.wait`, which
also makes its writes visible) before it reads its input or writes anything.

The rule every kernel launched with PDL keeps: `pdl_wait` comes before any load of data a kernel of
the same step may write, before any store, and before any early return (a kernel whose programs all
returned without waiting could finish before its predecessor). Before the wait a kernel may read
what nothing in the step writes: weights, the step's metadata (copied in before its first kernel),
and KV cache rows of earlier positions (stored by earlier steps; every step starts and ends with
launches made without PDL, the embedding and the sampler, which wait for everything before them).
Kernels take `PDL: tl.constexpr = False`;
`run_launch` (hal/kernels/launch.py) turns it on for every kernel with that parameter when
`enabled(device)`.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENV = "LOOPSTACK_PDL"            # "0" turns PDL off; "1" on where the device and Triton have it


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Let the next kernel launch, then wait for the previous one (a no-op unless PDL)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@functools.cache
def _triton_has_gdc() -> bool:
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


@functools.cache
def _device_has_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether launches on `device` use PDL: a CUDA (not ROCm) device of compute capability 9.0 or
    newer, a Triton with grid dependency control, and LOOPSTACK_PDL not "0"."""
    if device.type != "cuda" or getattr(torch.version, "hip", None) or os.environ.get(ENV, "1") == "0":
        return False
    return _triton_has_gdc() and _device_has_pdl(device.index if device.index is not None
                                                 else torch.cuda.current_device())
