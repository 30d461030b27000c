"""Which Triton target a launch goes to, and the launch options a `KernelConfig` turns into.

The vendor is read from Triton's active driver (the GPU the tensors live on), never from
`torch.version.hip`: the same wheel of hal/kernels serves CUDA and ROCm.

Triton compiles a kernel once per class of each integer argument (1, a multiple of 16, any other) and
of each pointer (16-byte aligned or not).
Integers that change from step to step (a batch's tokens and sequences, its block tables' width) are
`do_not_specialize`, and pointers into a plane of the step's staged arrays `do_not_specialize_on_alignment`,
in the kernels that eager steps launch: otherwise a step of sizes in a new class
would compile a variant inside the step, a second or more on the device (tests/kernels/test_specialisation.py).
Decode kernels keep theirs: they run captured at fixed sizes, where one sequence is worth folding.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from triton import knobs

from hal.kernels import pdl
from hal.kernels.configs import KernelConfig


class Target(NamedTuple):
    backend: str        # "cuda", "hip", or "interpreter" (CPU tensors under TRITON_INTERPRET=1)
    arch: str           # "sm_90", "gfx942", "cpu"
    warp_size: int


class Launch(NamedTuple):
    """One kernel launch, fully described: what `run_launch` executes and what xcompile compiles."""

    kernel: Any                   # a triton.jit function
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]        # constexprs and launch options


def is_interpreting() -> bool:
    """Whether Triton launches run in the CPU interpreter now (`TRITON_INTERPRET=1`)."""
    return bool(knobs.runtime.interpret)


@functools.cache
def _gpu_target() -> Target:
    from triton.runtime import driver

    target = driver.active.get_current_target()
    arch = f"sm_{target.arch}" if target.backend == "cuda" else str(target.arch).split(":")[0]
    return Target(target.backend, arch, target.warp_size)


def target_of(device: torch.device) -> Target:
    """The Triton target that kernels on `device` compile for."""
    if device.type == "cpu":
        return Target("interpreter", "cpu", 1)
    return _gpu_target()


def check_device(t: torch.Tensor) -> None:
    """Raise a clear error for CPU tensors outside the interpreter (instead of a driver crash)."""
    if t.device.type == "cpu" and not is_interpreting():
        raise RuntimeError("hal.kernels runs Triton kernels on a GPU; for CPU tensors set TRITON_INTERPRET=1 "
                           "(the Triton interpreter) or use the CPU Hal's torch code")


def backend_of(device: torch.device) -> str:
    """"cuda", "hip" or "interpreter": what a launch on `device` compiles for."""
    return target_of(device).backend


def launch_options(config: KernelConfig, target: str) -> dict[str, Any]:
    """`num_warps`/`num_stages`, plus the AMD-only keys when `target` is "hip"."""
    options: dict[str, Any] = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if target == "hip":
        options["waves_per_eu"] = config.waves_per_eu
        options["matrix_instr_nonkdim"] = config.matrix_instr_nonkdim
        options["kpack"] = config.kpack
    return options


# Launch options of kernels whose bytes another kernel must reproduce (rotary: the standalone write
# and the row kernel's fused one). With contraction on, the sm_90 compiler fused the NeoX product and
# difference of one kernel into a single `fma.rn.bf16` but not the other's, so about a quarter of the
# rotated keys differed by an ulp; without it every product and sum rounds as written, in both.
EXACT_ROUNDING: dict[str, Any] = {"enable_fp_fusion": False}


def run_launch(launch: Launch) -> None:
    """Launch; a kernel that takes `PDL` gets programmatic dependent launch where the device has it
    (hal/kernels/pdl.py)."""
    kwargs = launch.kwargs
    if _takes_pdl(launch.kernel) and pdl.enabled(_device_of(launch.args)):
        kwargs = {**kwargs, "PDL": True, "launch_pdl": True}
    launch.kernel[launch.grid](*launch.args, **kwargs)


@functools.cache
def _takes_pdl(kernel: Any) -> bool:
    return "PDL" in getattr(kernel, "arg_names", ())


def _device_of(args: tuple[Any, ...]) -> torch.device:
    return next(a.device for a in args if isinstance(a, torch.Tensor))


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
