"""The context a forward runs in: `ModelOps` (the Hal a forward computes with), `KVSpec` (how a
model's attention layers map onto KV planes), the `ForwardContext` protocol, and the dense context.

`ctx` carries token positions, per-step caches (rotary tables), attention, the recurrent initial
state's draws, and `ops`: the Hal the forward computes with (dense attention, fused ops). The dense
causal context below serves training and tests; the runtime's paged context serves inference. A
model never looks a Hal up by itself: whoever runs it hands the ops over in the context.

Apart from the model contract (zoo/base.py) because two sides meet here: the models call it and the
runtime implements it (runtime/execution/context.py), and neither needs the other's half.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol

import torch

from hal.attention import dense_attention

if TYPE_CHECKING:                  # annotations only: zoo.base imports this module
    from zoo.base import LoopedCausalLM

FUSED_OPS_ENV = "LOOPSTACK_FUSED_OPS"      # 0: every layer takes its plain torch expression


class ModelOps:
    """What a forward needs from a Hal: `dense` attention and fused ops by name (`Hal.op`), looked
    up once. `ModelOps()` (no Hal) is plain torch. Fused ops apply only while no gradient is
    recorded: training always takes the differentiable torch expressions."""

    def __init__(self, hal: Any = None, fused: bool | None = None) -> None:
        self.hal = hal
        self.is_fused = os.environ.get(FUSED_OPS_ENV, "1") != "0" if fused is None else fused
        self._ops: dict[str, Callable[..., Any] | None] = {}

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              causal: bool = True) -> torch.Tensor:
        """Causal attention without a cache, `q: [B, H, T, D]`, `k, v: [B, KVH, S, D]` (`Hal.dense`)."""
        if self.hal is None:
            return dense_attention(q, k, v, scale=scale, causal=causal)
        return self.hal.dense(q, k, v, scale=scale, causal=causal)

    def op(self, name: str) -> Callable[..., Any] | None:
        """The Hal's fused op `name`, or None: then the caller runs the plain torch expression."""
        if self.hal is None or not self.is_fused or torch.is_grad_enabled():
            return None
        if name not in self._ops:
            self._ops[name] = self.hal.op(name)
        return self._ops[name]


PLAIN_OPS = ModelOps()           # plain torch: what a forward uses when nobody hands it a Hal


class KVSpec(NamedTuple):
    """How a model's attention layers map onto KV planes.

    Planes `0 .. num_fixed_planes - 1` are written once per token (Huginn's prelude and coda
    layers); plane `num_fixed_planes + d` holds the KV of loop `d`. Each plane has
    `layers_per_plane` layer slots of `[num_kv_heads, head_dim]` per token.
    """

    num_kv_heads: int
    head_dim: int
    layers_per_plane: int
    num_fixed_planes: int = 0

    def num_planes(self, num_loops: int) -> int:
        return self.num_fixed_planes + num_loops


class ForwardContext(Protocol):
    """What a model needs from whoever runs it."""

    positions: torch.Tensor   # [B, T] int64 position of every token in its sequence
    ops: ModelOps             # the Hal this forward computes with

    def cached(self, key: Any, fn: Callable[[], Any]) -> Any:
        """`fn()` computed once per forward pass (rotary tables shared by every loop)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plane: int, layer: int,
               scale: float) -> torch.Tensor:
        """Causal attention of `q: [B, T, H, D]` given this step's `k, v: [B, T, KVH, D]`, which the
        context stores in KV plane `plane`, layer slot `layer`. Returns `[B, T, H, D]`."""

    def attend_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plane: int, layer: int, scale: float,
                      theta: float, interleaved: bool) -> torch.Tensor:
        """`attend` of q and k rotated (rotary embedding at `positions`, NeoX halves or adjacent pairs
        when `interleaved`); the runtime fuses the rotation with the KV write where its backend can."""

    def initial_state(self, model: "LoopedCausalLM", e: torch.Tensor) -> torch.Tensor:
        """The recurrence's starting state `[B, T, model.initial_state_width]` for the prelude output
        `e` (models with `has_initial_state`). The context decides the draws: one scale and generator
        for the whole call (dense), or each request's own (the runtime)."""


class BaseContext:
    """What every forward context shares: `cached` (values computed once per forward pass and shared
    by its loops) and `attend_rotary` as rotary then `attend` (a context whose backend fuses the two
    overrides it)."""

    def __init__(self) -> None:
        self._cache: dict[Any, Any] = {}

    def attend_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plane: int, layer: int, scale: float,
                      theta: float, interleaved: bool) -> torch.Tensor:
        from zoo.rope import rotate

        q, k = rotate(q, k, self, q.shape[-1], theta, interleaved)
        return self.attend(q, k, v, plane, layer, scale)

    def cached(self, key: Any, fn: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def clear_cached(self) -> None:
        """Forget the pass's values (the next pass has other positions)."""
        self._cache.clear()


class DenseContext(BaseContext):
    """Plain causal attention over the tokens of this call, no cache: training, tests, references.
    `ops` (default plain torch) is the Hal to compute with; `init_scale` and `generator` are the
    recurrent initial state's draw (`LoopedCausalLM.initial_state`)."""

    def __init__(self, positions: torch.Tensor, ops: ModelOps | None = None, init_scale: float | None = None,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.positions = positions
        self.ops = ops or PLAIN_OPS
        self.init_scale, self.generator = init_scale, generator

    @classmethod
    def for_tokens(cls, x: torch.Tensor, ops: ModelOps | None = None, **draw: Any) -> "DenseContext":
        """Positions 0..T-1 for every row of `x: [B, T, ...]`."""
        batch, seq = x.shape[:2]
        return cls(torch.arange(seq, device=x.device).expand(batch, seq), ops, **draw)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plane: int, layer: int,
               scale: float) -> torch.Tensor:
        out = self.ops.dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, causal=True)
        return out.transpose(1, 2)

    def initial_state(self, model: "LoopedCausalLM", e: torch.Tensor) -> torch.Tensor:
        return model.initial_state(e, self.init_scale, self.generator)

