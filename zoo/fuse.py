"""Inference-time fusion of projections that read the same input: q|k|v and gate|up become one
matrix each, so a step runs one GEMM where it ran three or two (fewer launches, one read of the
input). The separate weights become views of the fused matrix, so no memory is added and
`state_dict()` is unchanged; the fused matrices are non-persistent buffers. Training code never
needs this (views of one tensor would share gradients' storage). FP8 linears (zoo/fp8.py) fuse the
same way, their per-row scales concatenated with their rows.
"""
from __future__ import annotations

import torch
from torch import nn

from zoo.layers import GQAttention, SwiGLU

# (module class, attribute holding the fused matrix, the projections it fuses, in row order)
FUSED_PROJECTIONS = ((GQAttention, "qkv", ("q_proj", "k_proj", "v_proj")),
                     (SwiGLU, "gate_up", ("gate_proj", "up_proj")))


def _fuse(linears: list[nn.Module]) -> torch.Tensor:
    from zoo.fp8 import Fp8Linear, fuse_fp8

    if all(isinstance(lin, Fp8Linear) for lin in linears):
        return fuse_fp8(linears)
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    row = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(fused[row:row + rows], requires_grad=False)
        row += rows
    return fused


@torch.no_grad()
def fuse_projections(model: nn.Module) -> nn.Module:
    """Fuse every `GQAttention`'s q/k/v and every `SwiGLU`'s gate/up in place (idempotent)."""
    for module in model.modules():
        for cls, attr, part_names in FUSED_PROJECTIONS:
            parts = [getattr(module, name) for name in part_names] if isinstance(module, cls) else []
            if parts and getattr(module, attr) is None and all(p.bias is None for p in parts):
                setattr(module, attr, _fuse(parts))
    return model
