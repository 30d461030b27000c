"""The looped-model contract every zoo family implements, and the exit-distribution math.

A looped model runs four stages, so the runtime can control depth without knowing the family:

    prelude(ids, ctx)       -> state   # embed (Huginn: scaled embed, prelude blocks, initial state)
    loop(state, depth, ctx) -> state   # one recurrence; its KV goes to the plane of `depth`
    exit_hazard(state)      -> [B, T] probability of exiting after this loop, or None (no gate)
    coda(state, ctx, rows)  -> logits  # Huginn: ln_f, coda blocks, ln_f, head; others: head

`state` is a tensor `[B, T, X]` whose rows are tokens; the runtime may select rows between loops.
`ctx` is the context the forward runs in (zoo/context.py): positions, caches, attention and the Hal.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zoo.context import ForwardContext, KVSpec


def exit_distribution(hazards: torch.Tensor) -> torch.Tensor:
    """`hazards: [..., S]` (probability of exiting after loop s given it was reached) ->
    `p: [..., S]`, p_s = hazard_s * prod_{j<s}(1 - hazard_j); the last loop takes what remains."""
    survive = torch.cumprod(1 - hazards, dim=-1)                         # P(not exited after s)
    reached = torch.cat([torch.ones_like(survive[..., :1]), survive[..., :-1]], dim=-1)
    pdf = hazards * reached
    return torch.cat([pdf[..., :-1], reached[..., -1:]], dim=-1)


def first_exit_step(pdf: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per token, the first loop whose cumulative exit probability reaches `threshold`
    (the last loop if none does). `pdf: [..., S]` -> `[...]` int64."""
    reached = torch.cumsum(pdf, dim=-1) >= threshold
    reached[..., -1] = True
    return reached.int().argmax(dim=-1)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor                          # [B, T, V] at the selected depth
    loss: torch.Tensor | None = None              # scalar, when labels were given
    exit_pdf: torch.Tensor | None = None          # [B, T, S] probability of exiting after loop s
    step_logits: torch.Tensor | None = None       # [S, B, T, V] when asked for
    num_loops: int = 0


class LoopedCausalLM(nn.Module):
    """Base class of the zoo's models: the four stages plus family metadata."""

    config_class: type
    # checkpoint names that may be absent or stored twice because they alias another weight
    tied_weights: dict[str, str] = {}
    # stored in some checkpoints, not weights of ours (rotary tables)
    ignored_checkpoint_keys: tuple[str, ...] = ()
    # token ids that end generation besides the config's eos (Ouro's <|im_end|>)
    extra_stop_token_ids: tuple[int, ...] = ()

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.gradient_checkpointing = False

    @property
    @abstractmethod
    def kv_spec(self) -> KVSpec: ...

    @property
    @abstractmethod
    def default_num_loops(self) -> int: ...

    # a recurrence that starts from a random state (Huginn): see `initial_state`
    has_initial_state: bool = False

    @property
    def initial_state_width(self) -> int:
        """The last dim of `initial_state`'s result (models with `has_initial_state`)."""
        raise NotImplementedError(f"{type(self).__name__} has no recurrent initial state")

    def initial_state(self, e: torch.Tensor, init_scale: float | None = None,
                      generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
        """The recurrence's starting state for the prelude output `e: [B, T, D]`, drawn with
        `init_scale` (None: the reference's default; 0: zeros) from `generator` (None: the global
        RNG), or made from `noise`, standard normals truncated at +-3 of the state's shape, the
        caller's draw (the engine's keyed one). Only models with `has_initial_state` have one."""
        raise NotImplementedError(f"{type(self).__name__} has no recurrent initial state")

    @property
    def default_exit_threshold(self) -> float:
        """Exit threshold when a caller gives none; 1.0 means every token runs all loops."""
        return 1.0

    @property
    def num_attention_heads(self) -> int:
        """Query heads of every attention layer."""
        return int(self.config.num_attention_heads)

    @property
    def max_seq_len(self) -> int:
        """Longest sequence (prompt + generated) the model's positions support."""
        return int(getattr(self.config, "max_position_embeddings", 1 << 20))

    @abstractmethod
    def prelude(self, input_ids: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor: ...

    @abstractmethod
    def loop(self, state: torch.Tensor, depth: int, ctx: ForwardContext | None = None) -> torch.Tensor: ...

    def exit_hazard(self, state: torch.Tensor) -> torch.Tensor | None:
        return None

    @abstractmethod
    def coda(self, state: torch.Tensor, ctx: ForwardContext | None = None,
             rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[B, R, V]` of the token rows `rows` (all rows when None). Layers with KV (Huginn's
        coda blocks) still run on every row; only the head is restricted to `rows`."""

    def num_kv_layers(self, num_planes: int) -> int:
        """KV entries (layer slots) one token writes across `num_planes` planes."""
        return self.kv_spec.layers_per_plane * num_planes

    def loop_modules(self) -> list[nn.Module]:
        """The modules `loop` applies: their weights are read once per loop (for roofline math)."""
        raise NotImplementedError(f"{type(self).__name__} does not list its loop modules")

    def step_weights_of_loop_modules(self) -> list[torch.Tensor]:
        """Tensors (or views) inside `loop_modules` that a step reads once, not once per loop (for
        roofline math): none unless a family hoists part of its loop out of it (Huginn's adapter)."""
        return []

    # ----- helpers shared by the families ---------------------------------------------------
    def stop_token_ids(self) -> tuple[int, ...]:
        eos = getattr(self.config, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return tuple(dict.fromkeys([*eos_ids, *self.extra_stop_token_ids]))

    def tie_weights(self) -> None:
        """Re-share tied parameters after loading assigned separate tensors."""

    def gradient_checkpointing_enable(self) -> None:
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    def run_loop(self, state: torch.Tensor, depth: int, ctx: ForwardContext) -> torch.Tensor:
        """`loop`, recomputed in backward when gradient checkpointing is on (one segment per loop)."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            # a checkpointed region must not fill the context's caches (torch.compile refuses the
            # side effect): modules with a `warm_context(ctx)` method fill them beforehand
            for module in self.modules():
                warm = getattr(module, "warm_context", None)
                if warm is not None:
                    warm(ctx)
            return checkpoint(self.loop, state, depth, ctx, use_reentrant=False)
        return self.loop(state, depth, ctx)

    def num_parameters(self) -> int:
        """Unique parameter elements (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Cross entropy of position t's logits against label t+1, `logits: [B, T, V]`, `labels: [B, T]`."""
    shifted = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    return nn.functional.cross_entropy(shifted, labels[:, 1:].reshape(-1), ignore_index=ignore_index)


MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def as_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """`torch.bfloat16`, "bfloat16", "bf16", "torch.bfloat16" -> torch.bfloat16; None and "auto"
    (vLLM's and transformers' spelling of "the checkpoint's dtype") -> None. Only the dtypes a model
    computes in (FP8 weights are `weights_dtype`'s, not this)."""
    if dtype is None:
        return None
    value = dtype
    if not isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
        if name == "auto":
            return None
        aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
        value = getattr(torch, aliases.get(name, name), None)
    if value not in MODEL_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one a model computes in; use 'bfloat16', 'float16', 'float32' "
                         f"(or 'float64'), or 'auto' for the checkpoint's (FP8 weights: engine.weights_dtype=fp8)")
    return value
