"""The simple generation path: one sequence at a time, a dense per-(plane, layer) KV cache, no
paging or batching. It is the oracle every fast path of the engine is compared against.

Early exit follows the checkpoint's reference code: every loop runs (so every plane's KV is
exact) and the logits come from the first loop whose cumulative exit probability reaches the
threshold.
"""
from __future__ import annotations

import torch

from hal.common.kv_quant import fake_quantize
from runtime.sampling_params import SamplingParams
from runtime.execution.keyed_random import keyed_truncated_normals
from runtime.execution.sampler import make_generator, sample_token
from runtime.execution.loops import first_exit_step_bounded
from zoo.base import LoopedCausalLM, exit_distribution, first_exit_step
from zoo.context import PLAIN_OPS, BaseContext, ModelOps


class CachedContext(BaseContext):
    """A growing dense KV cache per (plane, layer); attention is bottom-right causal. With an 8-bit
    `kv_dtype` every new token's K and V are rounded as a quantized paged cache stores them
    (hal/common/kv_quant.py: per token and head, fixed when written), so the engine with `kv_dtype` set
    gives this path's tokens wherever it computes the same K and V; a pass of another shape (a prompt
    padded to its bucket, other chunks) computes them a float32 rounding apart, which quantizing can
    widen to a step: equal there up to near-ties (docs/fp8.md, "Exactness"). `ops` is the Hal to
    compute with (default plain torch)."""

    def __init__(self, generator: torch.Generator | None = None, init_scale: float | None = None,
                 kv_dtype: torch.dtype | None = None, ops: ModelOps | None = None, seed: int | None = None) -> None:
        super().__init__()
        self.ops = ops or PLAIN_OPS
        self.kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.positions = torch.zeros(1, 0, dtype=torch.long)
        self.generator, self.init_scale, self.kv_dtype, self.seed = generator, init_scale, kv_dtype, seed

    def begin_step(self, positions: torch.Tensor) -> None:
        self.positions = positions
        self.clear_cached()

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plane: int, layer: int,
               scale: float) -> torch.Tensor:
        # q: [B, T, H, D]; k, v: [B, T, KVH, D] for the new tokens only
        if self.kv_dtype is not None:
            k, v = fake_quantize(k, self.kv_dtype), fake_quantize(v, self.kv_dtype)
        if (plane, layer) in self.kv:
            past_k, past_v = self.kv[(plane, layer)]
            k, v = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)
        self.kv[(plane, layer)] = (k, v)
        out = self.ops.dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, causal=True)
        return out.transpose(1, 2)

    def initial_state(self, model: LoopedCausalLM, e: torch.Tensor) -> torch.Tensor:
        """A seeded request's draw keyed by (seed, position), as the engine's (step_inputs.draw_initial_states)."""
        noise = None
        if self.seed is not None and self.init_scale != 0:
            noise = keyed_truncated_normals(self.seed, self.positions, model.initial_state_width)
        return model.initial_state(e, self.init_scale, self.generator, noise=noise)


@torch.no_grad()
def forward_step(model: LoopedCausalLM, ids: torch.Tensor, ctx: CachedContext, num_loops: int,
                 exit_threshold: float, min_loops: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits `[T, V]` (float32) of the new tokens `ids: [T]` and the loops each one's logits came
    from (with early exit, never before `min_loops`, and at the last loop where that is past it)."""
    state = model.prelude(ids[None], ctx)
    states, hazards = [], []
    for depth in range(num_loops):
        state = model.loop(state, depth, ctx)
        hazard = model.exit_hazard(state) if exit_threshold < 1.0 else None
        if hazard is not None:
            states.append(state)
            hazards.append(hazard)
    if hazards:
        pdf = exit_distribution(torch.stack(hazards, -1))[0]                                     # [T, L]
        if min_loops <= 1:
            exit_step = first_exit_step(pdf, exit_threshold)                                      # [T]
        else:
            full = lambda value: torch.full((pdf.shape[0],), value, device=pdf.device)  # noqa: E731
            exit_step = first_exit_step_bounded(pdf, full(exit_threshold), full(min_loops), full(num_loops))
        stacked = torch.stack(states)[:, 0]                                           # [S, T, X]
        state = stacked.gather(0, exit_step[None, :, None].expand(1, *stacked.shape[1:]))
        return model.coda(state, ctx)[0].float(), exit_step + 1
    return model.coda(state, ctx)[0].float(), torch.full((ids.shape[0],), num_loops)


def generate_reference(model: LoopedCausalLM, prompt_ids: list[int], params: SamplingParams,
                       stop_token_ids: tuple[int, ...] = (), kv_dtype: torch.dtype | None = None,
                       ops: ModelOps | None = None) -> tuple[list[int], str, list[int]]:
    """Generate for one prompt (`kv_dtype`, `ops`: see `CachedContext`). Returns (token ids, finish
    reason, loops per token)."""
    device = next(model.parameters()).device
    num_loops = params.num_loops or model.default_num_loops
    threshold = model.default_exit_threshold if params.exit_threshold is None else params.exit_threshold
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(stop_token_ids))
    ctx = CachedContext(make_generator(params, device), params.init_scale, kv_dtype, ops, params.seed)
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=device)
    position, out, loops = 0, [], []
    while True:
        ctx.begin_step(torch.arange(position, position + ids.shape[0], device=device)[None])
        logits, exit_loops = forward_step(model, ids, ctx, num_loops, threshold, params.min_loops)
        position += ids.shape[0]
        token = sample_token(logits[-1], params, prompt_ids, out, stops)
        out.append(token)
        loops.append(int(exit_loops[-1]))
        if token in stops:
            return out, "stop", loops
        if params.max_tokens is not None and len(out) >= params.max_tokens or position + 1 >= model.max_seq_len:
            return out, "length", loops
        ids = torch.tensor([token], dtype=torch.long, device=device)
