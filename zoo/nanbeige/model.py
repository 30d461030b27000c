"""Nanbeige4.2 (Nanbeige LLM Lab, BOSS Zhipin): a Llama-style GQA decoder whose layer stack runs
`num_loops` times per token, with the final norm after every loop. No gate, no input injection.

    h = embed(ids)
    for loop in loops:  for layer:  h = h + attn(ln_in(h));  h = h + mlp(ln_post(h))
                        h = norm(h)
    logits = lm_head(h)

The attention width `num_heads * head_dim` (6144) differs from the hidden size (3072). KV: every
layer per loop, plane = loop index (the reference's cache slot `layer + loop * L`).

Where the Hal has `norm_add_norm` (and no `linear`, which adds the residuals in the projections'
epilogues), each residual add runs with the norm after it in one launch: `+ attn` with ln_post,
`+ mlp` with the next layer's ln_in (the last layer's: the loop's final norm). Per layer and loop
that is 2 launches instead of 4 (2 adds, 2 norms).
"""
from __future__ import annotations

from operator import attrgetter

import torch
from torch import nn

from zoo.base import CausalLMOutput, LoopedCausalLM, causal_lm_loss
from zoo.context import DenseContext, ForwardContext, KVSpec, ModelOps
from zoo.layers import (GQAttention, RMSNorm, SwiGLU, feeds_fp8, fuses_pre_norm_boundaries, norm_add_norm,
                        run_layers)
from zoo.nanbeige.config import NanbeigeConfig

_INPUT_NORM = attrgetter("input_layernorm")    # a layer's input norm, which the layer before may run
_INPUT_MATRIX = attrgetter("self_attn.qkv")     # the projection after it (None until fused)


class NanbeigeDecoderLayer(nn.Module):
    def __init__(self, cfg: NanbeigeConfig) -> None:
        super().__init__()
        self.self_attn = GQAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                     cfg.head_dim, cfg.rope_theta)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx: ForwardContext, plane: int, layer: int,
                normed: torch.Tensor | None = None, next_norm: RMSNorm | None = None, quantize_next: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`h + attn(ln_in(h))`, then `h + mlp(ln_post(h))`. Returns `(h, None)`, or `(h, next_norm(h))`
        where the Hal runs the last residual add and `next_norm` in one kernel (quantized for the next
        layer's FP8 q|k|v with `quantize_next`). `normed` is ln_in(h) when the layer before computed it
        so; q|k|v then take it as is."""
        # h, normed: [B, T, hidden]
        if not fuses_pre_norm_boundaries(ctx, h):
            # the norms run in the q|k|v and gate|up projections, the residual adds in the o and
            # down projections, when the context's Hal has those fused ops (decode). No layer
            # returned a `normed` then: this branch makes none
            h = self.self_attn(h, ctx, plane, layer, norm=self.input_layernorm, residual=h)
            return self.mlp(h, ctx, norm=self.post_attention_layernorm, residual=h), None
        # each residual add and the norm after it in one norm_add_norm kernel (`h = h + sublayer`,
        # as `project(..., residual=h)` adds it)
        if normed is None:
            attn = self.self_attn(h, ctx, plane, layer, norm=self.input_layernorm)
        else:
            attn = self.self_attn(normed, ctx, plane, layer)
        normed, h = norm_add_norm(attn, h, None, self.post_attention_layernorm, ctx,
                                  quantized=feeds_fp8(self.mlp.gate_up))
        if next_norm is None:
            return self.mlp(normed, ctx, residual=h), None
        next_normed, h = norm_add_norm(self.mlp(normed, ctx), h, None, next_norm, ctx, quantized=quantize_next)
        return h, next_normed


class NanbeigeModel(nn.Module):
    def __init__(self, cfg: NanbeigeConfig) -> None:
        super().__init__()
        # padding_idx as in the reference: the pad row gets no gradient
        pad = cfg.pad_token_id
        pad = pad if pad is not None and 0 <= pad < cfg.vocab_size else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=pad)
        self.layers = nn.ModuleList(NanbeigeDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class NanbeigeForCausalLM(LoopedCausalLM):
    config_class = NanbeigeConfig
    extra_stop_token_ids = (166101,)    # <|im_end|>

    def __init__(self, config: NanbeigeConfig) -> None:
        super().__init__(config)
        self.model = NanbeigeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.tied_weights = {"lm_head.weight": "model.embed_tokens.weight"}
            self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def kv_spec(self) -> KVSpec:
        c = self.config
        return KVSpec(c.num_key_value_heads, c.head_dim, c.num_hidden_layers, 0)

    @property
    def default_num_loops(self) -> int:
        return self.config.num_loops

    def loop_modules(self) -> list[nn.Module]:
        return [self.model.layers, self.model.norm]

    # ----- the four stages ------------------------------------------------------------------
    def prelude(self, input_ids: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)                            # [B, T, hidden]

    def loop(self, state: torch.Tensor, depth: int, ctx: ForwardContext | None = None) -> torch.Tensor:
        ctx = ctx or DenseContext.for_tokens(state)
        state, normed = run_layers(self.model.layers, state, ctx, depth, _INPUT_NORM, self.model.norm,
                                   input_matrix=_INPUT_MATRIX)
        return self.model.norm(state, ctx) if normed is None else normed

    def coda(self, state: torch.Tensor, ctx: ForwardContext | None = None,
             rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not None:
            state = state.index_select(1, rows)
        return self.lm_head(state)                                           # [B, R, V]

    # ----- training / reference forward ----------------------------------------------------
    def forward(self, input_ids: torch.Tensor, num_loops: int | None = None,
                labels: torch.Tensor | None = None, exit_threshold: float | None = None,
                return_step_logits: bool = False, ops: ModelOps | None = None) -> CausalLMOutput:
        """`input_ids: [B, T]`; logits after `num_loops` (default `config.num_loops`) passes of the
        layer stack. With `labels` the loss is the causal-shifted cross entropy (labels = input_ids).
        `return_step_logits` also returns the head's logits after every loop (`[S, B, T, V]`); `ops`
        is the Hal to compute with."""
        if exit_threshold is not None and exit_threshold < 1.0:
            raise ValueError("Nanbeige has no exit gate: exit_threshold must be None or 1.0")
        num_loops = num_loops or self.config.num_loops
        ctx = DenseContext.for_tokens(input_ids, ops)
        h = self.prelude(input_ids, ctx)
        steps = []
        for depth in range(num_loops):
            h = self.run_loop(h, depth, ctx)
            if return_step_logits:
                steps.append(self.coda(h, ctx))
        logits = steps[-1] if steps else self.coda(h, ctx)
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        return CausalLMOutput(logits=logits, loss=loss, num_loops=num_loops,
                              step_logits=torch.stack(steps) if steps else None)
