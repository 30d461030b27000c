"""Attention backend choice on CUDA and ROCm: the Triton kernels (`hal/kernels`) where they take
the shape, the plain-torch reference otherwise. The choice carries its reason (logged once by the
Hal); an explicit request that cannot be met raises instead of falling back.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any, NamedTuple, Sequence

import torch

from hal.attention import AttentionBackend
from hal.common.torch_attention import TorchPagedAttention

TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_TRITON_HEAD_DIM = 128            # the kernels' tiles are compile-checked up to this; wider go to torch
FUSED_OPS = ("rms_norm", "norm_add_norm", "rotary", "silu_and_mul")    # hal/kernels/ops.py
GEMV_OPS = ("linear", "rms_norm_linear", "silu_mul_linear", "norm_residual_linear",  # hal/kernels/gemv_ops.py
            "projection_takes")
GEMV_MAX_ROWS = 8                # gemv_ops.MAX_ROWS (not imported here: hal.kernels needs Triton)
TRITON_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


class Choice(NamedTuple):
    name: str                        # one of the Hal's backend names
    reason: str                      # why; logged once


@functools.lru_cache(maxsize=None)
def triton_status() -> tuple[bool, str]:
    """Whether the Triton backend can run here (triton and `hal.kernels` import), and why not."""
    try:
        import triton
    except Exception as exc:  # ImportError, or a broken install raising anything
        return False, f"triton does not import ({type(exc).__name__}: {exc})"
    try:
        importlib.import_module("hal.kernels.backend")
    except Exception as exc:
        return False, f"hal.kernels does not import ({type(exc).__name__}: {exc})"
    return True, f"triton {getattr(triton, '__version__', '?')}"


def why_not(name: str, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> str | None:
    """Why backend `name` cannot serve this shape (and 8-bit KV format), or None when it can."""
    if name == "torch":
        return None
    if name == "triton":
        is_ok, status = triton_status()
        if not is_ok:
            return status
        if dtype not in TRITON_DTYPES:
            return f"the Triton kernels take {', '.join(str(d) for d in TRITON_DTYPES)}, not {dtype}"
        if head_dim > MAX_TRITON_HEAD_DIM:
            return f"head_dim {head_dim} is above the Triton kernels' {MAX_TRITON_HEAD_DIM}"
        if kv_dtype not in (None, dtype) and kv_dtype not in TRITON_KV_DTYPES:
            return f"the Triton kernels quantize KV to FP8 only, not {kv_dtype}"
        return None
    raise ValueError(f"no rule for attention backend {name!r}")


def check_known(requested: str | None, order: Sequence[str], hal_name: str) -> None:
    """Raise ValueError unless `requested` is "auto" or one of `order` (at construction, so a
    misspelt `attention_backend=` fails at start, not at the first step)."""
    if requested not in (None, "auto") and requested not in order:
        raise ValueError(f"hal {hal_name} has no attention backend {requested!r}; "
                         f"choose one of auto, {', '.join(order)}")


def choose(requested: str | None, order: Sequence[str], head_dim: int, dtype: torch.dtype,
           hal_name: str, kv_dtype: torch.dtype | None = None) -> Choice:
    """`requested` "auto" (or None) takes the first of `order` that serves the shape; a named
    backend must serve it or this raises ValueError naming the reason and the alternatives."""
    requested = requested or "auto"
    shape = f"head_dim={head_dim} {dtype}" + (f" with {kv_dtype} KV" if kv_dtype not in (None, dtype) else "")
    if requested == "auto":
        skipped = []
        for name in order:
            why = why_not(name, head_dim, dtype, kv_dtype)
            if why is None:
                note = f"; skipped {'; '.join(skipped)}" if skipped else ""
                return Choice(name, f"auto: first of ({', '.join(order)}) that serves {shape}{note}")
            skipped.append(f"{name}: {why}")
        raise RuntimeError(f"hal {hal_name}: no attention backend serves {shape}: {'; '.join(skipped)}")
    check_known(requested, order, hal_name)
    why = why_not(requested, head_dim, dtype, kv_dtype)
    if why is not None:
        others = [n for n in order if n != requested]
        raise ValueError(f"attention backend {requested!r} was requested on hal {hal_name} but cannot serve "
                         f"{shape}: {why}. Fix that, or use attention_backend=auto "
                         f"(or one of {', '.join(others)})")
    return Choice(requested, f"requested explicitly; serves {shape}")


def build(name: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
          device: torch.device, block_size: int, configs: dict[str, Any] | None,
          kv_dtype: torch.dtype | None = None, fresh_attention: str | None = None) -> AttentionBackend:
    """Construct the chosen backend; the Triton one gets the Hal's per-arch kernel configs and the
    Hal's way to attend prefills without context (`hal.kernels.fresh`: "flash", "sdpa" or None)."""
    quantized = {} if kv_dtype is None else {"kv_dtype": kv_dtype}
    if name == "triton":
        from hal.kernels.backend import TritonPagedAttention

        return TritonPagedAttention(num_heads, num_kv_heads, head_dim, dtype, device, block_size,
                                    configs=configs, fresh_attention=fresh_attention, **quantized)
    if name == "torch":
        return TorchPagedAttention(num_heads, num_kv_heads, head_dim, dtype, device, block_size, **quantized)
    raise ValueError(f"no attention backend {name!r}")


def kernel_configs(arch: str) -> dict[str, Any]:
    """The Triton launch configs (`KernelConfig` per kernel) for `arch`, from `hal.kernels`."""
    from hal.kernels.configs import configs_for

    return configs_for(arch)


def fused_op(name: str, configs: dict[str, Any] | None = None, num_compute_units: int | None = None,
             max_rows: int = GEMV_MAX_ROWS, gemm: Any = None) -> Any:
    """A Triton fused op by name bound to the arch's launch configs (and, for the decode
    projections, the device's compute units and the rows they take fused), or None (unknown name,
    or Triton unusable here)."""
    if name not in FUSED_OPS + GEMV_OPS or not triton_status()[0]:
        return None
    if name in GEMV_OPS:
        gemv_ops = importlib.import_module("hal.kernels.gemv_ops")
        return gemv_ops.gemv_ops(configs, num_compute_units, max_rows, gemm)[name]
    ops = importlib.import_module("hal.kernels.ops")
    return ops.fused_ops(configs).get(name)
