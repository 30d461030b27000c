"""Rotary position embeddings: NeoX halves ("rotate_half", Ouro and Nanbeige) and GPT-J adjacent
pairs (Huginn). The torch expressions here define what the Hals' rotary ops compute; `attend_rotary`
lets the forward context fuse the rotation with the KV write where its backend can.
"""
from __future__ import annotations

import torch

from zoo.context import ForwardContext


def rotate(q: torch.Tensor, k: torch.Tensor, ctx: ForwardContext, head_dim: int, theta: float,
           interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of `q: [B, T, H, D]`, `k: [B, T, KVH, D]` at `ctx.positions`; NeoX halves or
    adjacent pairs (`interleaved`)."""
    fused = ctx.ops.op("rotary")
    if fused is not None and q.shape[-1] == head_dim:
        q2, k2 = fused(q.flatten(0, 1), k.flatten(0, 1), ctx.positions.flatten(), theta, interleaved)
        return q2.view_as(q), k2.view_as(k)
    cos, sin = ctx.cached(("rope", head_dim, theta), lambda: rope_tables(ctx.positions, head_dim, theta))
    apply = apply_rope_interleaved if interleaved else apply_rope_half
    return apply(q, cos, sin), apply(k, cos, sin)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[B, T, head_dim // 2]` in float32 for `positions: [B, T]`."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX / Llama rotary ("rotate_half"): pairs (x[i], x[i + D/2]). `x: [B, T, H, D]`."""
    cos = torch.cat([cos, cos], -1)[:, :, None].to(x.dtype)
    sin = torch.cat([sin, sin], -1)[:, :, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J / complex rotary: adjacent pairs (x[2i], x[2i+1]), computed in float32. `x: [B, T, H, D]`."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = cos[:, :, None], sin[:, :, None]
    even, odd = pairs[..., 0], pairs[..., 1]
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


def attend_rotary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext, plane: int, layer: int,
                  scale: float, head_dim: int, theta: float, interleaved: bool) -> torch.Tensor:
    """`ctx.attend` of the rotated q and k: the context rotates (`ForwardContext.attend_rotary`, in
    one kernel with the KV write where the runtime's backend can) when the rotation spans the whole
    head, with the Hal's rotary op in use; otherwise `rotate` here."""
    if q.shape[-1] == head_dim and ctx.ops.op("rotary") is not None:
        return ctx.attend_rotary(q, k, v, plane, layer, scale, theta, interleaved)
    q, k = rotate(q, k, ctx, head_dim, theta, interleaved)
    return ctx.attend(q, k, v, plane, layer, scale)
