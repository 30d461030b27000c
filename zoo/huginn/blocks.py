"""Huginn-0125's sandwich block and its parts: `x = n2(attn(n1(x)) + x); x = n4(mlp(n3(x)) + x)`.

Where the Hal has `norm_add_norm`, a block's boundaries are one launch each: attention's residual
add, n2 and n3 inside the block; the MLP's add, n4 and the next block's n1 (the coda's last block:
ln_f) across blocks of one run. Per block that is 2 launches instead of 6 (2 adds, 4 norms), less
at a run's edges: the prelude's and a core loop's last block keep their add and n4 (the concat and
the adapter come next), every run's first n1 is its own norm.
"""
from __future__ import annotations

import torch
from torch import nn

from zoo.context import ForwardContext
from zoo.huginn.config import HuginnConfig
from zoo.layers import RMSNorm, feeds_fp8, linear_weight, norm_add_norm, ops_of, project, silu_mul_project
from zoo.rope import attend_rotary, rope_tables


class HuginnAttention(nn.Module):
    """Fused `Wqkv` (rows q | k | v), a per-head q/k bias added before the interleaved rotary."""

    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.n_heads, cfg.num_key_value_heads, cfg.head_dim
        self.rope_base = cfg.rope_base
        self.split = (cfg.n_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
                      cfg.num_key_value_heads * cfg.head_dim)
        self.Wqkv = nn.Linear(cfg.n_embd, sum(self.split), bias=False)
        if cfg.qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, cfg.n_heads, cfg.head_dim))   # [q|k, 1, H, D]
        else:
            self.qk_bias = None
        self.proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.n_embd, bias=False)

    def warm_context(self, ctx: ForwardContext) -> None:
        """Fill the context's rotary cache before a checkpointed loop (see `LoopedCausalLM.run_loop`)."""
        ctx.cached(("rope", self.head_dim, self.rope_base),
                   lambda: rope_tables(ctx.positions, self.head_dim, self.rope_base))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, plane: int, layer: int,
                norm: RMSNorm | None = None) -> torch.Tensor:
        """`proj(attention(norm(x)))`; the norm runs in the q|k|v projection where fused (decode)."""
        # x: [B, T, n_embd]
        qkv = project(x, self.Wqkv, ctx, norm)                                # [B, T, (H + 2 KVH) D]
        if self.qk_bias is not None:
            # q and k are adjacent columns: both biases in one add (a launch per block at decode)
            qk = qkv[..., :self.split[0] + self.split[1]]
            qk += self.qk_bias.reshape(qk.shape[-1])
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))                   # [B, T, H, D]
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))                # [B, T, KVH, D]
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        out = attend_rotary(q, k, v, ctx, plane, layer, self.head_dim ** -0.5, self.head_dim, self.rope_base,
                            True)                                              # [B, T, H, D]
        return project(out.flatten(-2), self.proj, ctx)


class GatedMLP(nn.Module):
    """`proj(silu(a) * b)` with `a, b` the two halves of one `fc` projection."""

    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 2 * cfg.intermediate_size, bias=False)
        self.proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        return self.down(self.fc(x), ctx)

    def down(self, fc_out: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """`proj(silu(a) * b)` of the fc output `[..., 2I]` (SwiGLU in proj's prologue where fused)."""
        return silu_mul_project(fc_out, self.proj, ctx)

    def forward_sandwich(self, x: torch.Tensor, residual: torch.Tensor, post_norm: RMSNorm, norm: RMSNorm,
                         ctx: ForwardContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The sandwich block's boundary: `h = post_norm(x + residual)`, then `self(norm(h))`. Returns
        `(mlp output, h)`; the add and both norms run in the fc projection's prologue where the Hal
        has `norm_residual_linear` (decode), else in one kernel before it where it has `norm_add_norm`."""
        weight = linear_weight(self.fc)
        fused = ops_of(ctx).op("norm_residual_linear") if weight is not None else None
        if fused is not None and post_norm.eps == norm.eps:
            fc_out, h = fused(x, residual, post_norm.weight, norm.weight, norm.eps, weight, sum_first=True)
            return self.down(fc_out, ctx), h
        normed = norm_add_norm(x, residual, post_norm, norm, ctx, sum_first=True, quantized=feeds_fp8(self.fc))
        if normed is not None:
            n, h = normed
            return self.down(project(n, self.fc, ctx), ctx), h
        h = post_norm(x + residual, ctx)
        return self.down(project(h, self.fc, ctx, norm), ctx), h


class SandwichBlock(nn.Module):
    """Norms after each residual add: `x = n2(attn(n1(x)) + x); x = n4(mlp(n3(x)) + x)`."""

    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = HuginnAttention(cfg)
        self.norm_2 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = GatedMLP(cfg)
        self.norm_3 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.norm_4 = RMSNorm(cfg.n_embd, cfg.norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, plane: int, layer: int,
                normed: torch.Tensor | None = None, next_norm: RMSNorm | None = None, quantize_next: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`x = n2(attn(n1(x)) + x)`, then `n4(mlp(n3(x)) + x)`. Returns `(x, None)`, or
        `(x, next_norm(x))` where the Hal runs the last add, n4 and `next_norm` in one kernel (quantized
        for the next block's FP8 q|k|v with `quantize_next`).
        `normed` is n1(x) when the block before computed it so; q|k|v then take it as is."""
        # x, normed: [B, T, n_embd]. With the Hal's fused ops (decode) n1 runs in the q|k|v
        # projection's prologue, the add + n2 + n3 in fc's or in one norm_add_norm kernel
        if normed is None:
            attn = self.attn(x, ctx, plane, layer, norm=self.norm_1)
        else:
            attn = self.attn(normed, ctx, plane, layer)
        mlp, x = self.mlp.forward_sandwich(attn, x, self.norm_2, self.norm_3, ctx)
        if next_norm is not None:
            fused = norm_add_norm(mlp, x, self.norm_4, next_norm, ctx, sum_first=True, quantized=quantize_next)
            if fused is not None:
                next_normed, x = fused
                return x, next_normed
        return self.norm_4(mlp + x, ctx), None
