"""Layers shared by the zoo's families: RMSNorm, SwiGLU, Llama-style attention (rotary: zoo/rope.py).

Each layer computes with the Hal of the forward it runs in (`ctx.ops`: its fused ops where it has
them); without a context, plain torch. The torch expressions here define what the fused ops compute.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zoo.context import PLAIN_OPS, ForwardContext, ModelOps
from zoo.fp8 import fp8_matrix
from zoo.rope import attend_rotary, rope_tables


def ops_of(ctx: ForwardContext | None) -> ModelOps:
    return PLAIN_OPS if ctx is None else ctx.ops


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in float32, cast back to the input dtype, then scale. With
    `residual`, returns `residual + norm(x)` (one fused kernel where the Hal has one)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        fused = ops_of(ctx).op("rms_norm")
        if fused is not None:
            return fused(x, self.weight, self.eps, residual)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * x32.to(x.dtype)
        return y if residual is None else residual + y


def norm_add_norm(x: torch.Tensor, residual: torch.Tensor, post_norm: RMSNorm | None, norm: RMSNorm,
                  ctx: ForwardContext | None = None, sum_first: bool = False, quantized: bool = False
                  ) -> tuple[Any, torch.Tensor] | None:
    """`(norm(h), h)` for the residual stream h at a sublayer boundary, in one kernel where the Hal
    has `norm_add_norm` (and the norms share eps); else None, and the caller runs its torch code. h:
    - `residual + post_norm(x)`: sandwich norms (Ouro);
    - `post_norm(x + residual)` with `sum_first`: Huginn's sandwich block;
    - `residual + x` without `post_norm`: pre-norm layers (the add `project(..., residual=)` makes).
    `quantized`: only an FP8 matrix takes norm(h); where the Hal's FP8 product would quantize these
    rows (`norm_add_norm_fp8`), norm(h) comes quantized (`QuantizedRows`), no launch of its own."""
    ops = ops_of(ctx)
    fused = ops.op("norm_add_norm")
    if fused is None or (post_norm is not None and post_norm.eps != norm.eps):
        return None
    post_weight = post_norm.weight if post_norm is not None else None
    fp8 = ops.op("norm_add_norm_fp8") if quantized else None
    if fp8 is not None:
        out = fp8(x, residual, post_weight, norm.weight, norm.eps, sum_first=sum_first)
        if out is not None:
            return out
    return fused(x, residual, post_weight, norm.weight, norm.eps, sum_first=sum_first)


def feeds_fp8(matrix: Any) -> bool:
    """Whether `matrix` (a projection after a norm boundary) is an FP8 one: `norm_add_norm`'s
    `quantized` for the boundary before it."""
    return fp8_matrix(matrix) is not None


def fuses_pre_norm_boundaries(ctx: ForwardContext | None, h: torch.Tensor) -> bool:
    """Whether a pre-norm layer over the stream `h: [..., hidden]` runs each residual add and the norm
    after it in one `norm_add_norm` kernel: where the Hal has that op and its decode projections
    (`linear`, ...) do not take this layer's normed projections. Where they do, the projection before
    the add adds the residual in its epilogue and the next one's prologue norms, no launch of their
    own, so the layer keeps them there."""
    ops = ops_of(ctx)
    if ops.op("norm_add_norm") is None:
        return False
    if ops.op("linear") is None:
        return True
    takes = ops.op("projection_takes")
    return takes is not None and not takes(h.numel() // h.shape[-1], h.shape[-1], after_norm=True)


def silu_and_mul(x: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
    """`silu(a) * b` for `x = cat(a, b)` on the last dim."""
    fused = ops_of(ctx).op("silu_and_mul")
    if fused is not None:
        return fused(x)
    gate, up = x.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def fused_linear(x: torch.Tensor, weight: Any, ctx: ForwardContext | None = None) -> torch.Tensor:
    """`x @ weight.T` for a fused projection matrix; an FP8 one (zoo/fp8.py) applies itself."""
    return nn.functional.linear(x, weight) if isinstance(weight, torch.Tensor) else weight(x, ops_of(ctx))


def linear_weight(module: Any) -> torch.Tensor | None:
    """The weight the Hal's projection ops take (`linear`, `rms_norm_linear`, ...): a fused matrix
    that is a plain tensor, or a bias-free `nn.Linear`'s; None for FP8 matrices, tensor-parallel
    layers (their own collectives) and biased layers, which keep their own forward."""
    if isinstance(module, torch.Tensor):
        return module
    if type(module) is nn.Linear and module.bias is None:
        return module.weight
    return None


def project(x: torch.Tensor, weight: Any, ctx: ForwardContext | None, norm: RMSNorm | None = None,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    """`linear(norm(x), weight) (+ residual)` (norm optional): one fused decode projection where the
    Hal has it (`rms_norm_linear` / `linear`), else the layers' own torch code. `weight` is a
    matrix, an FP8 matrix or a linear module."""
    plain = linear_weight(weight)
    if plain is not None:
        if norm is not None and residual is None:
            fused = ops_of(ctx).op("rms_norm_linear")
            if fused is not None:
                return fused(x, norm.weight, norm.eps, plain)
        elif norm is None:
            fused = ops_of(ctx).op("linear")
            if fused is not None:
                return fused(x, plain, residual)
    if norm is not None:
        x = norm(x, ctx)
    y = weight(x) if isinstance(weight, nn.Module) else fused_linear(x, weight, ctx)
    return y if residual is None else residual + y


def silu_mul_project(x: torch.Tensor, down: nn.Module, ctx: ForwardContext | None,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """`down(silu_and_mul(x)) (+ residual)` for `x: [..., 2I]` = gate | up: SwiGLU in the projection's
    prologue and the add in its epilogue where the Hal has `silu_mul_linear` (`silu_mul_fp8_linear`
    for an FP8 `down`), else silu_and_mul, then the layer's own forward."""
    ops = ops_of(ctx)
    plain = linear_weight(down)
    if plain is not None:
        fused = ops.op("silu_mul_linear")
        if fused is not None:
            return fused(x, plain, residual)
    else:
        fp8 = fp8_matrix(down)
        fused = ops.op("silu_mul_fp8_linear") if fp8 is not None else None
        if fused is not None:
            return fused(x, fp8.weight, fp8.scale, residual)
    y = down(silu_and_mul(x, ctx))
    return y if residual is None else residual + y


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`, no bias. After `zoo.fuse.fuse_projections`, gate and up are
    one matrix (`gate_up`, a non-persistent buffer whose halves the two weights view)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: Any = None                   # [2I, hidden] tensor (or FP8 matrix) once fused

    def forward(self, x: torch.Tensor, ctx: ForwardContext | None = None, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """`down(silu(gate(n(x))) * up(n(x)))` with `n = norm` (or none), `+ residual` when given: the
        norm runs in the gate|up projection's prologue, SwiGLU in the down projection's, the residual
        add in its epilogue, where the Hal has those ops (decode batches)."""
        if self.gate_up is None:
            x = norm(x, ctx) if norm is not None else x
            y = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
            return y if residual is None else residual + y
        return self.down(project(x, self.gate_up, ctx, norm), ctx, residual)

    def down(self, gate_up: torch.Tensor, ctx: ForwardContext | None = None,
             residual: torch.Tensor | None = None) -> torch.Tensor:
        """`down(silu(gate) * up) (+ residual)` of the gate|up projection's output `[..., 2I]`."""
        return silu_mul_project(gate_up, self.down_proj, ctx, residual)

    def forward_sandwich(self, x: torch.Tensor, residual: torch.Tensor, post_norm: RMSNorm, norm: RMSNorm,
                         ctx: ForwardContext | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sandwich norms around a sublayer boundary (Ouro): the residual stream
        `h = residual + post_norm(x)` of the sublayer before, then `self(norm(h))`. Returns
        `(mlp output, h)`; the two norms run in the gate|up projection's prologue where the Hal
        has `norm_residual_linear`, else in one kernel before it where it has `norm_add_norm`."""
        weight = linear_weight(self.gate_up)
        fused = ops_of(ctx).op("norm_residual_linear") if weight is not None else None
        if fused is not None and post_norm.eps == norm.eps:
            gate_up, h = fused(x, residual, post_norm.weight, norm.weight, norm.eps, weight)
            return self.down(gate_up, ctx), h
        normed = norm_add_norm(x, residual, post_norm, norm, ctx, quantized=feeds_fp8(self.gate_up))
        if normed is not None:
            n, h = normed
            return self(n, ctx), h
        h = post_norm(x, ctx, residual=residual)
        return self(h, ctx, norm), h


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
        self.qkv: Any = None                       # q|k|v as one matrix after zoo.fuse.fuse_projections

    def project(self, x: torch.Tensor, ctx: ForwardContext | None = None, norm: RMSNorm | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of `norm(x)` (the input norm in the q|k|v projection's prologue where fused)."""
        if self.qkv is not None:
            sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                     self.num_kv_heads * self.head_dim)
            return project(x, self.qkv, ctx, norm).split(sizes, dim=-1)
        x = norm(x, ctx) if norm is not None else x
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def rope(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[B, T, head_dim // 2]` for the context's positions, computed once per forward."""
        return ctx.cached(("rope", self.head_dim, self.rope_theta),
                          lambda: rope_tables(ctx.positions, self.head_dim, self.rope_theta))

    def warm_context(self, ctx: ForwardContext) -> None:
        """Fill the context's caches before a checkpointed loop (see `LoopedCausalLM.run_loop`)."""
        self.rope(ctx)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, plane: int, layer: int, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """`o_proj(attention(norm(x))) (+ residual)`; `norm` and `residual` fold into the projections
        where the Hal has the ops (decode batches)."""
        # x: [B, T, hidden]
        q, k, v = self.project(x, ctx, norm)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))                  # [B, T, H, D]
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))               # [B, T, KVH, D]
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        out = attend_rotary(q, k, v, ctx, plane, layer, self.scale, self.head_dim, self.rope_theta, False)
        return project(out.flatten(-2), self.o_proj, ctx, residual=residual)


def run_layers(layers: nn.ModuleList, x: torch.Tensor, ctx: ForwardContext, plane: int,
               input_norm: Callable[[nn.Module], RMSNorm], final_norm: RMSNorm | None = None,
               first_slot: int = 0, input_matrix: Callable[[nn.Module], Any] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`x: [B, T, hidden]` through a run of layers on KV plane `plane` (layer slots from
    `first_slot`). Each layer is handed the norm that follows it (the next layer's `input_norm`, the
    last one's `final_norm`) to run with its last residual add in one kernel where the Hal has
    `norm_add_norm`, and then the next layer takes that normalised input; quantized for it
    (`quantize_next`) where the next layer's `input_matrix`, the projection after that norm, is FP8.
    Returns `(x, final_norm(x))` where the last layer fused it, else `(x, None)`."""
    next_norms = [input_norm(layer) for layer in layers[1:]] + [final_norm]
    quantize = [input_matrix is not None and feeds_fp8(input_matrix(layer)) for layer in layers[1:]] + [False]
    normed = None                      # next_norm(x) when the layer fused it with its last add
    for i, (layer, next_norm) in enumerate(zip(layers, next_norms)):
        x, normed = layer(x, ctx, plane, first_slot + i, normed, next_norm, quantize_next=quantize[i])
    return x, normed
