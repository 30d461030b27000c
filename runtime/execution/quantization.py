"""The engine's quantization settings, resolved against the Hal: `EngineConfig.kv_dtype` (the KV
cache's 8-bit format, hal/common/kv_quant.py) and `EngineConfig.weights_dtype` (FP8 linears, zoo/fp8.py).

The Hal says which formats its hardware reads (`Caps.fp8_dtype`, `Caps.kv_quant_dtypes`): "fp8"
means that Hal's FP8 (e4m3fn on H100/H200, gfx950 and the CPU reference; e4m3fnuz on gfx942);
explicit formats (`fp8_e4m3fnuz`) let the CPU reference emulate another vendor's numerics. A format
the Hal cannot read is refused at engine start with the alternatives named.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from hal.base import Hal
from zoo.context import ModelOps
from hal.common.kv_quant import KV_DTYPE_NAMES

log = logging.getLogger(__name__)

KV_DTYPES = ("auto", "fp8", *KV_DTYPE_NAMES)
WEIGHTS_DTYPES = ("auto", "fp8")


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    by_dtype = {d: n for n, d in KV_DTYPE_NAMES.items()}
    return ", ".join(by_dtype.get(d, str(d)) for d in dtypes) or "none"


def resolve_kv_dtype(name: str, hal: Hal) -> torch.dtype | None:
    """`kv_dtype` of EngineConfig -> the 8-bit format for `hal.attention(kv_dtype=...)`, or None
    (the model dtype). Raises ValueError naming what this Hal reads instead."""
    if name == "auto":
        return None
    caps = hal.caps
    readable = caps.kv_quant_dtypes
    if name == "fp8":
        dtype = caps.fp8_dtype
        if dtype is None:
            raise ValueError(f"kv_dtype=fp8: hal {hal.name} ({caps.arch}) has no FP8 format (Caps.fp8_dtype is "
                             f"None); its attention reads 8-bit KV as: {_names(readable)}. Use one of those "
                             f"(kv_dtype=int8 on Ascend) or kv_dtype=auto")
    else:
        dtype = KV_DTYPE_NAMES[name]
    if dtype not in readable:
        choices = ["auto"] + (["fp8"] if caps.fp8_dtype in readable else []) + \
            [n for n, d in KV_DTYPE_NAMES.items() if d in readable]
        raise ValueError(f"kv_dtype={name}: hal {hal.name} ({caps.arch}) reads 8-bit KV as {_names(readable)}, "
                         f"not {dtype}; use kv_dtype=" + " or ".join(dict.fromkeys(choices)))
    return dtype


def prepare_weights(model: nn.Module, ops: ModelOps, weights_dtype: str) -> None:
    """`weights_dtype=fp8`: swap the model's linears for per-output-channel FP8 ones in the Hal's
    format (after `fuse_projections`, so fused matrices are quantized as one). Models loaded with FP8
    weights (a pre-quantized checkpoint, or `zoo.from_pretrained(..., weights_dtype="fp8")`) are
    converted to the Hal's format whatever this says."""
    from zoo.fp8 import has_fp8_weights, quantize_fp8

    if weights_dtype == "auto" and not has_fp8_weights(model):
        return
    hal = ops.hal
    fp8 = hal.caps.fp8_dtype
    if fp8 is None:
        raise ValueError(f"weights_dtype=fp8 (or an FP8 checkpoint): hal {hal.name} ({hal.caps.arch}) has no FP8 "
                         f"format (Caps.fp8_dtype is None); load the bf16 checkpoint with weights_dtype=auto")
    num = quantize_fp8(model, fp8, ops)
    log.info("FP8 weights (%s, per output channel): %d linears", fp8, num)
