"""Huginn-0125 (Geiping et al. 2025, "raven"): prelude blocks, a recurrent core applied `num_loops`
times to `adapter(cat[state, prelude_out])` from a random initial state, then coda blocks.

    e = prelude(wte(ids) * embed_scale);  s = initial_state(e)
    for k in loops:  s = core(adapter(cat[s, e]))
    logits = head(ln_f(coda(ln_f(s))))            # head tied to wte

The adapter's product splits by its input columns, `adapter(cat[s, e]) = s @ W_s^T + c` with
`c = e @ W_e^T + b`, and c is the same in every loop. So the looped-model state is `cat([s, c], -1)`
(`[B, T, 2 * n_embd]`): the prelude computes c once per step and each loop reads only the state half
of the adapter's weight (at Huginn-0125's size the other half is 56 MB in bf16, read 32 times a
decode step before). KV planes: plane 0 holds the prelude (slots 0..p-1) and coda (slots p..p+c-1)
layers, written once per token; loop d's core layers write plane 1 + d. The blocks (and how their
norms fuse across a run): zoo/huginn/blocks.py.
"""
from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch
from torch import nn

from zoo.base import CausalLMOutput, LoopedCausalLM, causal_lm_loss
from zoo.context import DenseContext, ForwardContext, KVSpec, ModelOps
from zoo.fp8 import Fp8Linear, Fp8Weight
from zoo.huginn.blocks import SandwichBlock
from zoo.huginn.config import HuginnConfig
from zoo.layers import RMSNorm, project, run_layers

_FIRST_NORM = attrgetter("norm_1")      # a block's first norm, which the block before may run
_FIRST_MATRIX = attrgetter("attn.Wqkv")  # the projection after it


class HuginnTransformer(nn.Module):
    def __init__(self, cfg: HuginnConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.n_embd)
        self.prelude = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_layers_in_prelude))
        self.adapter = nn.Linear(2 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)   # input columns: state, then e
        self.core_block = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_layers_in_recurrent_block))
        self.coda = nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_layers_in_coda))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps)                        # used twice by the coda


def split_num_loops(num_loops: int | tuple[int, int], default: int) -> tuple[int, int]:
    """`num_loops` -> (loops without gradient, loops with gradient). An int runs every loop with
    gradient; Huginn's `(no_grad_steps, grad_steps)` tuple truncates backpropagation."""
    if num_loops is None:
        return 0, default
    if isinstance(num_loops, (tuple, list)):
        if len(num_loops) != 2:
            raise ValueError(f"num_loops as a pair must be (no_grad_loops, grad_loops), got {num_loops!r}")
        no_grad, with_grad = (int(n) for n in num_loops)
    else:
        no_grad, with_grad = 0, int(num_loops)
    if no_grad < 0 or with_grad < 0 or no_grad + with_grad < 1:
        raise ValueError(f"num_loops must give at least one loop and no negative counts, got {num_loops!r}")
    return no_grad, with_grad


class HuginnForCausalLM(LoopedCausalLM):
    config_class = HuginnConfig
    extra_stop_token_ids = (65505, 65508)     # <|end_text|>, <|end_turn|> (generation_config's eos list)
    ignored_checkpoint_keys = ("freqs_cis",)  # the reference's persistent rotary table; we compute it

    def __init__(self, config: HuginnConfig) -> None:
        super().__init__(config)
        self.transformer = HuginnTransformer(config)
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        if config.tie_embeddings:
            # the hub file may store the tied matrix under both names; either one is enough
            self.tied_weights = {"lm_head.weight": "transformer.wte.weight"}
            self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    @property
    def kv_spec(self) -> KVSpec:
        c = self.config
        fixed = c.n_layers_in_prelude + c.n_layers_in_coda
        return KVSpec(c.num_key_value_heads, c.head_dim, max(fixed, c.n_layers_in_recurrent_block), 1)

    @property
    def default_num_loops(self) -> int:
        return self.config.mean_recurrence

    @property
    def max_seq_len(self) -> int:
        return self.config.block_size

    @property
    def num_attention_heads(self) -> int:
        return self.config.n_heads

    def num_kv_layers(self, num_planes: int) -> int:
        c = self.config
        return c.n_layers_in_prelude + c.n_layers_in_coda + (num_planes - 1) * c.n_layers_in_recurrent_block

    def loop_modules(self) -> list[nn.Module]:
        return [self.transformer.adapter, self.transformer.core_block]

    def step_weights_of_loop_modules(self) -> list[torch.Tensor]:
        """The adapter's prelude half and bias: `c = e @ W_e^T + b` is computed once per step."""
        w_e = self.adapter_halves()[1]
        bias = self.transformer.adapter.bias
        return [getattr(w_e, "weight", w_e)] + ([bias] if bias is not None else [])

    has_initial_state = True

    @property
    def initial_state_width(self) -> int:
        return self.config.n_embd

    def initial_state(self, e: torch.Tensor, init_scale: float | None = None,
                      generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
        """The recurrence's starting state for prelude output `e: [B, T, n_embd]`: a normal truncated
        at 3 std, std `init_values.std * init_scale`, times `embed_scale`; zeros when `init_scale=0`.
        `init_scale=None` is the reference's default 1.0. Draws from `generator` (or the global RNG),
        or scales `noise` (standard normals truncated at 3, `e`'s shape)."""
        std = self.config.init_std * (1.0 if init_scale is None else init_scale)
        if std <= 0:
            return torch.zeros_like(e)
        if noise is not None:
            return (noise.reshape(e.shape).to(e.device) * std).to(e.dtype) * self.config.embed_scale
        # the reference overwrites a randn draw with the truncated normal; drawing it too advances the
        # RNG as the reference does, so one global seed gives both the same state
        state = torch.randn(e.shape, generator=generator, dtype=e.dtype, device=e.device)
        nn.init.trunc_normal_(state, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
        return state * self.config.embed_scale

    # ----- the four stages ------------------------------------------------------------------
    def adapter_halves(self) -> tuple[Any, Any]:
        """`(W_s, W_e)`: the adapter weight's columns that multiply the state and the prelude output,
        as views of its one matrix (the checkpoint's tensor, nothing copied). For an FP8 adapter
        (zoo/fp8.py) FP8 matrices that share its row scales: a row's scale covers both halves, so
        each half dequantizes exactly as the whole does. Tensor parallelism keeps the adapter whole."""
        adapter, n = self.transformer.adapter, self.config.n_embd
        if isinstance(adapter, Fp8Linear):
            scale = adapter.weight_scale
            return Fp8Weight(adapter.weight[:, :n], scale), Fp8Weight(adapter.weight[:, n:], scale)
        if not isinstance(adapter, nn.Linear):
            raise TypeError(f"Huginn's adapter is an nn.Linear or an Fp8Linear, not {type(adapter).__name__}: "
                            f"split its weight by input columns in HuginnForCausalLM.adapter_halves")
        return adapter.weight[:, :n], adapter.weight[:, n:]

    def prelude(self, input_ids: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        """`[B, T]` ids -> state `[B, T, 2 * n_embd]` = cat(initial state, c) with `c = e @ W_e^T + b`
        the adapter's product with the prelude output e; the context draws the initial state
        (`ForwardContext.initial_state`)."""
        ctx = ctx or DenseContext.for_tokens(input_ids)
        e = self.transformer.wte(input_ids) * self.config.embed_scale              # [B, T, n_embd]
        e, _ = run_layers(self.transformer.prelude, e, ctx, 0, _FIRST_NORM, input_matrix=_FIRST_MATRIX)
        # the prelude half of the adapter, once per step (every loop adds the same c)
        c = project(e, self.adapter_halves()[1], ctx)
        bias = self.transformer.adapter.bias
        if bias is not None:
            c = c + bias
        return torch.cat([ctx.initial_state(self, e), c], dim=-1)

    def loop(self, state: torch.Tensor, depth: int, ctx: ForwardContext | None = None) -> torch.Tensor:
        ctx = ctx or DenseContext.for_tokens(state)
        n = self.config.n_embd
        s, c = state[..., :n], state[..., n:]
        s = project(s, self.adapter_halves()[0], ctx, residual=c)      # adapter(cat[s, e]) = s @ W_s^T + c
        s, _ = run_layers(self.transformer.core_block, s, ctx, 1 + depth, _FIRST_NORM,
                          input_matrix=_FIRST_MATRIX)
        return torch.cat([s, c], dim=-1)

    def coda(self, state: torch.Tensor, ctx: ForwardContext | None = None,
             rows: torch.Tensor | None = None) -> torch.Tensor:
        ctx = ctx or DenseContext.for_tokens(state)
        ln_f = self.transformer.ln_f
        x = ln_f(state[..., :self.config.n_embd], ctx)
        # every row: the coda writes KV. ln_f after it comes out of the last block's norm_add_norm
        # (of every row: one launch either way) where fused, else it norms the rows asked for only
        x, normed = run_layers(self.transformer.coda, x, ctx, 0, _FIRST_NORM, ln_f,
                               self.config.n_layers_in_prelude, _FIRST_MATRIX)
        if normed is None:
            normed = ln_f(x if rows is None else x.index_select(1, rows), ctx)
        elif rows is not None:
            normed = normed.index_select(1, rows)
        return self.lm_head(normed)                                                    # [B, R, V]

    # ----- training / reference forward ----------------------------------------------------
    def forward(self, input_ids: torch.Tensor, num_loops: int | tuple[int, int] | None = None,
                labels: torch.Tensor | None = None, exit_threshold: float | None = None,
                return_step_logits: bool = False, ops: ModelOps | None = None,
                init_scale: float | None = None, generator: torch.Generator | None = None) -> CausalLMOutput:
        """`input_ids: [B, T]`. `num_loops` defaults to `mean_recurrence` in training and eval alike (the
        reference samples it in train mode; pass it explicitly, or `(no_grad_loops, grad_loops)` to
        backpropagate through the last loops only). `init_scale`/`generator` set the random initial
        state. With `labels` the loss is the causal-shifted cross entropy (labels = input_ids works),
        like the other families; the reference's own loss does not shift. `return_step_logits` also
        returns the coda's logits after every loop (`[S, B, T, V]`); `ops` is the Hal to compute with."""
        if exit_threshold is not None and exit_threshold < 1.0:
            raise ValueError("Huginn has no exit gate: exit_threshold must be None or 1.0")
        no_grad_loops, grad_loops = split_num_loops(num_loops, self.config.mean_recurrence)
        ctx = DenseContext.for_tokens(input_ids, ops, init_scale=init_scale, generator=generator)
        state = self.prelude(input_ids, ctx)
        c = state[..., self.config.n_embd:]
        steps = []
        with torch.no_grad():
            for depth in range(no_grad_loops):
                state = self.loop(state, depth, ctx)
                if return_step_logits:
                    steps.append(self.coda(state, ctx))
        if no_grad_loops:
            # the loops without gradient return c detached; the loops with gradient take the
            # prelude's, so that gradient reaches W_e and the prelude, as in the reference (whose
            # every loop reads the prelude output)
            state = torch.cat([state[..., :self.config.n_embd], c], dim=-1)
        for depth in range(no_grad_loops, no_grad_loops + grad_loops):
            state = self.run_loop(state, depth, ctx)
            if return_step_logits:
                steps.append(self.coda(state, ctx))
        logits = steps[-1] if steps else self.coda(state, ctx)
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        return CausalLMOutput(logits=logits, loss=loss, num_loops=no_grad_loops + grad_loops,
                              step_logits=torch.stack(steps) if steps else None)
