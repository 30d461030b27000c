"""Ouro (ByteDance Seed): a Llama-like decoder with sandwich norms whose layer stack runs
`total_ut_steps` times per token, with an exit gate after every loop.

    h = embed(ids)
    for t in loops:  for layer:  h = h + norm_a2(attn(norm_a1(h)));  h = h + norm_m2(mlp(norm_m1(h)))
                     h = norm(h);  hazard_t = sigmoid(gate(h));  logits_t = lm_head(h)

Where the Hal has `norm_add_norm`, every boundary between sublayers is one launch: norm_a2, the
add and norm_m1 inside a layer; norm_m2, the add and the next layer's norm_a1 (the last layer's:
the loop's final norm) across layers. Per layer and loop that is 2 norm launches instead of 4.
"""
from __future__ import annotations

from operator import attrgetter

import torch
from torch import nn

from zoo.base import CausalLMOutput, LoopedCausalLM, causal_lm_loss, exit_distribution, first_exit_step
from zoo.context import DenseContext, ForwardContext, KVSpec, ModelOps
from zoo.layers import GQAttention, RMSNorm, SwiGLU, norm_add_norm, run_layers
from zoo.ouro.config import OuroConfig
from zoo.training import expected_exit_loss

LOSS_TYPES = ("expected_logits", "expected_loss")
DEFAULT_ENTROPY_WEIGHT = 0.05   # beta of the entropy regulariser when the caller gives none

_INPUT_NORM = attrgetter("input_layernorm")    # a layer's input norm, which the layer before may run
_INPUT_MATRIX = attrgetter("self_attn.qkv")     # the projection after it (None until fused)


class OuroDecoderLayer(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.self_attn = GQAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                     cfg.head_dim, cfg.rope_theta)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx: ForwardContext, plane: int, layer: int,
                normed: torch.Tensor | None = None, next_norm: RMSNorm | None = None, quantize_next: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`h + norm_a2(attn(norm_a1(h)))`, then `h + norm_m2(mlp(norm_m1(h)))`. Returns `(h, None)`, or
        `(h, next_norm(h))` where the Hal runs norm_m2, the add and `next_norm` in one kernel (quantized
        for the next layer's FP8 q|k|v with `quantize_next`, zoo.layers.run_layers).
        `normed` is norm_a1(h) when the layer before computed it so; q|k|v then take it as is."""
        # h, normed: [B, T, hidden]. With the Hal's fused ops (decode) norm_a1 runs in the q|k|v
        # projection's prologue, norm_a2 + add + norm_m1 in gate|up's or in one norm_add_norm kernel
        if normed is None:
            attn = self.self_attn(h, ctx, plane, layer, norm=self.input_layernorm)
        else:
            attn = self.self_attn(normed, ctx, plane, layer)
        mlp, h = self.mlp.forward_sandwich(attn, h, self.input_layernorm_2, self.post_attention_layernorm, ctx)
        if next_norm is not None:
            fused = norm_add_norm(mlp, h, self.post_attention_layernorm_2, next_norm, ctx, quantized=quantize_next)
            if fused is not None:
                next_normed, h = fused
                return h, next_normed
        return self.post_attention_layernorm_2(mlp, ctx, residual=h), None


class OuroModel(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1, bias=True)


class OuroForCausalLM(LoopedCausalLM):
    config_class = OuroConfig
    extra_stop_token_ids = (0, 2)    # <|endoftext|>, <|im_end|>: the config lists only 0

    def __init__(self, config: OuroConfig) -> None:
        super().__init__(config)
        self.model = OuroModel(config)
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
        return KVSpec(c.num_key_value_heads, c.head_dim, c.num_hidden_layers)

    @property
    def default_num_loops(self) -> int:
        return self.config.total_ut_steps

    def loop_modules(self) -> list[nn.Module]:
        return [self.model.layers, self.model.norm, self.model.early_exit_gate]

    @property
    def default_exit_threshold(self) -> float:
        return self.config.early_exit_threshold

    # ----- the four stages ------------------------------------------------------------------
    def prelude(self, input_ids: torch.Tensor, ctx: ForwardContext | None = None) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)                            # [B, T, hidden]

    def loop(self, state: torch.Tensor, depth: int, ctx: ForwardContext | None = None) -> torch.Tensor:
        ctx = ctx or DenseContext.for_tokens(state)
        state, normed = run_layers(self.model.layers, state, ctx, depth, _INPUT_NORM, self.model.norm,
                                   input_matrix=_INPUT_MATRIX)
        return self.model.norm(state, ctx) if normed is None else normed

    def exit_hazard(self, state: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.model.early_exit_gate(state).float()).squeeze(-1)   # [B, T]

    def coda(self, state: torch.Tensor, ctx: ForwardContext | None = None,
             rows: torch.Tensor | None = None) -> torch.Tensor:
        if rows is not None:
            state = state.index_select(1, rows)
        return self.lm_head(state)                                           # [B, R, V]

    # ----- training / reference forward ----------------------------------------------------
    def forward(self, input_ids: torch.Tensor, num_loops: int | None = None, labels: torch.Tensor | None = None,
                exit_threshold: float | None = None, return_step_logits: bool = False, ops: ModelOps | None = None,
                loss_type: str = "expected_logits", entropy_weight: float | None = None) -> CausalLMOutput:
        """`input_ids: [B, T]`. Logits come from the last loop, or with `exit_threshold=q < 1` per
        token from the first loop whose cumulative exit probability reaches q.

        With `labels: [B, T]` (-100 = ignore) the loss is, by `loss_type`:
        - "expected_logits" (default, the released reference code's loss): cross entropy of the
          exit-weighted expected logits `sum_s p_s * logits_s`;
        - "expected_loss" (the Ouro paper's training objective): `sum_s p_s * CE_s - beta * H(p)`
          per token, `beta = entropy_weight` (default 0.05); see `zoo.training.expected_exit_loss`.
        """
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
        if entropy_weight is not None and loss_type != "expected_loss":
            raise ValueError("entropy_weight applies to loss_type='expected_loss' only")
        num_loops = num_loops or self.config.total_ut_steps
        threshold = self.config.early_exit_threshold if exit_threshold is None else exit_threshold
        ctx = DenseContext.for_tokens(input_ids, ops)
        h = self.prelude(input_ids, ctx)
        states, hazards = [], []
        for depth in range(num_loops):
            h = self.run_loop(h, depth, ctx)
            states.append(h)
            hazards.append(self.exit_hazard(h))
        pdf = exit_distribution(torch.stack(hazards, dim=-1))                # [B, T, S]

        need_steps = labels is not None or return_step_logits or threshold < 1.0
        per_step = [self.coda(s) for s in states] if need_steps else None   # S x [B, T, V]
        # the expected-loss objective scores each step's logits apart: no [S, B, T, V] stack needed
        need_stack = return_step_logits or threshold < 1.0 or (labels is not None and loss_type == "expected_logits")
        step_logits = torch.stack(per_step) if need_stack else None           # [S, B, T, V]
        if threshold < 1.0:
            exit_step = first_exit_step(pdf, threshold)                      # [B, T]
            logits = step_logits.gather(0, exit_step[None, ..., None].expand(1, *step_logits.shape[1:]))[0]
        else:
            logits = per_step[-1] if per_step is not None else self.coda(h)
        loss = None
        if labels is not None and loss_type == "expected_loss":
            beta = DEFAULT_ENTROPY_WEIGHT if entropy_weight is None else entropy_weight
            loss = expected_exit_loss(per_step, pdf, labels, entropy_weight=beta).loss
        elif labels is not None:
            expected = (pdf.permute(2, 0, 1)[..., None].to(step_logits.dtype) * step_logits).sum(0)
            loss = causal_lm_loss(expected, labels)
        return CausalLMOutput(logits=logits, loss=loss, exit_pdf=pdf,
                              step_logits=step_logits if return_step_logits else None, num_loops=num_loops)
