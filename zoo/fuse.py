"""Inference-time fusion of projections that read the same input: q|k|v and gate|up become one
matrix each, so a step runs one GEMM where it ran three or two (fewer launches, one read of the
input). The separate weights become views of the fused matrix, so no memory is added and
`state_dict()` is unchanged; the fused matrices are non-persistent buffers. Training code never
needs this (views of one tensor would share gradients' storage).
"""
from __future__ import annotations

import torch
from torch import nn

from zoo.layers import GQAttention, SwiGLU


def _fuse(linears: list[nn.Linear]) -> torch.Tensor:
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
        if isinstance(module, GQAttention) and module.qkv is None and module.q_proj.bias is None:
            module.qkv = _fuse([module.q_proj, module.k_proj, module.v_proj])
        elif isinstance(module, SwiGLU) and module.gate_up is None:
            module.gate_up = _fuse([module.gate_proj, module.up_proj])
    return model
