"""Running hal/kernels under the Triton interpreter on the CPU, for tests.

`triton.jit` fixes a function's mode when it is decorated: with `TRITON_INTERPRET=1` set before
triton is imported, every kernel (and triton.language's own jit helpers such as `tl.cdiv`) becomes
an interpreted function, and nothing can be cross-compiled in that process any more. So instead of
an import-time switch, `interpreter()` interprets the kernels launched inside it: it sets
`TRITON_INTERPRET=1` (what `triton.knobs` and `hal.kernels.launch.is_interpreting` read) and routes
`JITFunction` launches and device-function calls to their interpreted twins, so numerics tests
and compile checks share one pytest session. Setting the variable before import still works.

It also works around four rounding bugs of the triton 3.9 interpreter:
1. `tl.dot` on bf16 operands multiplies the raw uint16 bit patterns (bf16 is stored as uint16):
   operands are widened to fp32 first, which is exact, as on an fp32-accumulating tensor core.
2. fp32 -> bf16 casts truncate where GPUs round to nearest even: the cast goes through torch.
3. casts to FP8 (e4m3fn, e4m3fnuz) lose the carry when rounding up crosses a power of two (1.99 -> 1,
   not 2) and mis-round fnuz subnormals: they go through torch (round to nearest even, as the GPUs'
   saturating conversions do for the in-range values our kernels produce).
4. bf16 -> fp32 casts get subnormals wrong (1.0e-39 widens to 4.4e-39): the cast shifts the bits
   into place, which is exact, as on the GPUs.
Everything is undone on exit.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as interp
from triton.runtime.jit import JITFunction

_INTERPRETED: dict[Callable, interp.InterpretedFunction] = {}


def _interpreted(fn: JITFunction) -> interp.InterpretedFunction:
    if fn.fn not in _INTERPRETED:
        _INTERPRETED[fn.fn] = interp.InterpretedFunction(fn.fn)
    return _INTERPRETED[fn.fn]


def _bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _fp32_to_bf16_bits(values: np.ndarray) -> np.ndarray:
    as_torch = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)
    return as_torch.view(torch.int16).numpy().view(np.uint16)


_TORCH_FP8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e4b8: torch.float8_e4m3fnuz}


def _to_fp8(src: interp.TensorHandle, dst: Any) -> interp.TensorHandle:
    values = _bf16_bits_to_fp32(src.data) if src.dtype.scalar == tl.bfloat16 else src.data.astype(np.float32)
    as_torch = torch.from_numpy(np.ascontiguousarray(values)).to(_TORCH_FP8[dst])
    return interp.TensorHandle(as_torch.view(torch.uint8).numpy(), dst)


def _is_float_to_fp8(src: interp.TensorHandle, dst_type: Any) -> bool:
    return dst_type.scalar in _TORCH_FP8 and src.dtype.scalar in (tl.float32, tl.bfloat16, tl.float16)


def _builder_patches() -> dict[str, Any]:
    builder = interp.InterpreterBuilder
    original_dot, original_cast, original_fp_to_fp = builder.create_dot, builder.cast_impl, builder.create_fp_to_fp

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = interp.TensorHandle(_bf16_bits_to_fp32(a.data), tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = interp.TensorHandle(_bf16_bits_to_fp32(b.data), tl.float32)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interp.TensorHandle(_fp32_to_bf16_bits(src.data), tl.bfloat16)
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            return interp.TensorHandle(_bf16_bits_to_fp32(src.data), tl.float32)
        if _is_float_to_fp8(src, dst_type):
            return _to_fp8(src, dst_type.scalar)
        return original_cast(self, src, dst_type)

    def create_fp_trunc(self, src, dst_type):
        return self.cast_impl(src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if _is_float_to_fp8(src, dst_type):
            return _to_fp8(src, dst_type.scalar)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    return {"create_dot": create_dot, "cast_impl": cast_impl, "create_fp_trunc": create_fp_trunc,
            "create_fp_to_fp": create_fp_to_fp}


def _jit_patches() -> dict[str, Any]:
    def run(self, *args, grid, warmup, **kwargs):
        return _interpreted(self).run(*args, grid=grid, warmup=warmup, **kwargs)

    def call(self, *args, **kwargs):          # a kernel calling a jit function (tl.cdiv, our helpers)
        # InterpretedFunction.__call__ patches triton.language for good (harmless when everything is
        # interpreted, fatal for later compiles here): patch for the call only, restoring after
        scope = interp._patch_lang(self.fn)
        try:
            return _interpreted(self).rewrite()(*args, **kwargs)
        finally:
            scope.restore()

    return {"run": run, "__call__": call}


@contextlib.contextmanager
def _patched(cls: type, patches: dict[str, Any]) -> Iterator[None]:
    saved = {name: cls.__dict__.get(name) for name in patches}
    for name, fn in patches.items():
        setattr(cls, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            if fn is None:
                delattr(cls, name)
            else:
                setattr(cls, name, fn)


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@contextlib.contextmanager
def interpreter() -> Iterator[None]:
    """Triton kernels launched inside run in the interpreter (CPU tensors), with the bf16 fixes."""
    # imported first: `triton.jit` under TRITON_INTERPRET=1 would make them interpreter-only for good
    import hal.kernels.attention
    import hal.kernels.gemv
    import hal.kernels.kv_write
    import hal.kernels.norms
    import hal.kernels.ops
    import hal.kernels.rotary_kv  # noqa: F401

    with _env("TRITON_INTERPRET", "1"), _patched(JITFunction, _jit_patches()), \
            _patched(interp.InterpreterBuilder, _builder_patches()):
        yield
