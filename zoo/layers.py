"""Layers shared by the zoo's families: RMSNorm, rotary embeddings, SwiGLU, Llama-style attention."""
from __future__ import annotations

import torch
from torch import nn

from zoo.base import ForwardContext


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in float32, cast back to the input dtype, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


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


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`, no bias."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class GQAttention(nn.Module):
    """Llama-style grouped-query attention with NeoX rotary; the attention width
    `num_heads * head_dim` may differ from `hidden` (Nanbeige, Ouro's GQA variant)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, rope_theta: float,
                 bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.scale = head_dim ** -0.5
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)

    def rope(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[B, T, head_dim // 2]` for the context's positions, computed once per forward."""
        return ctx.cached(("rope", self.head_dim, self.rope_theta),
                          lambda: rope_tables(ctx.positions, self.head_dim, self.rope_theta))

    def warm_context(self, ctx: ForwardContext) -> None:
        """Fill the context's caches before a checkpointed loop (see `LoopedCausalLM.run_loop`)."""
        self.rope(ctx)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, plane: int, layer: int) -> torch.Tensor:
        # x: [B, T, hidden]
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))      # [B, T, H, D]
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))   # [B, T, KVH, D]
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        cos, sin = self.rope(ctx)
        q, k = apply_rope_half(q, cos, sin), apply_rope_half(k, cos, sin)
        out = ctx.attend(q, k, v, plane, layer, self.scale)                   # [B, T, H, D]
        return self.o_proj(out.flatten(-2))
