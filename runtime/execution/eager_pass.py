"""The runner's eager pass: any step a captured pass cannot run (runtime/execution/runner.py picks),
packed into one forward pass: prompts, prompt chunks and decodes together, and wavefront segments
(`ScheduledRequest.is_wave`, docs/scheduling.md).

A wavefront segment runs one loop at its `depth`: the model runs it as loop 0 over the tables of
plane `fixed + depth` (`step_inputs.shifted_tables`), which relies on the looped-model contract (a
loop's computation depends on its depth only through the KV plane it reads and writes). Rows that
enter the loops run the prelude; a segment with loops to go keeps its state in `wave_states` until
the next step; rows that finish their last loop run the coda. A decoding token that stopped at its
exit loop has its KV copied into the deeper planes it skipped, where the KV layout asks for that.
"""
from __future__ import annotations

from typing import Sequence

import torch

from hal.attention import AttentionBackend
from runtime.engine.kv_cache import BlockManager
from runtime.engine.planes import PlaneLayout
from runtime.engine.step_schedule import ScheduledRequest
from runtime.execution.async_step import PendingStep
from runtime.execution.logprobs import prompt_logits, prompt_rows
from runtime.execution.loops import SeqPlan, run_loops
from runtime.execution.step_inputs import PassEnv, SeqSlice, describe, place, shifted_tables
from zoo.base import LoopedCausalLM
from zoo.context import KVSpec


class EagerPass:
    """The eager pass of `ModelRunner`, which inherits it and sets what it reads below; it stops at
    the logits, which the runner samples (`ModelRunner.finish_step`)."""

    model: LoopedCausalLM
    kv_spec: KVSpec
    layout: PlaneLayout
    env: PassEnv
    backend: AttentionBackend
    kv_caches: list[torch.Tensor]
    block_size: int
    device: torch.device
    wave_states: dict[tuple[str, int], torch.Tensor]    # (request id, first token) -> state [1, n, X]

    def slice_of(self, item: ScheduledRequest, blocks: BlockManager) -> SeqSlice:
        req = item.request
        tables = blocks.block_tables(req.request_id)
        shift = item.depth if item.is_wave else 0
        return SeqSlice(req, item.first_token, item.num_tokens, shifted_tables(tables, self.kv_spec.num_fixed_planes, shift))

    def eager_pass(self, scheduled: Sequence[ScheduledRequest], blocks: BlockManager,
                   fed_from: PendingStep | None) -> tuple[torch.Tensor | None, list, list[int], int, tuple | None]:
        """Run the step's rows -> (logits `[R, V]` of the sampling rows or None, their requests, the
        loops behind each, the number of rows, prompt logprob rows and logits or None)."""
        model, fixed = self.model, self.kv_spec.num_fixed_planes
        slices = [self.slice_of(item, blocks) for item in scheduled]
        host = describe(slices, max(len(s.tables) for s in slices), self.block_size)
        inputs = place(self.env, host, fed_from)
        ctx = inputs.ctx
        plans, starts, entering, finishing = [], [], [], []
        row = 0
        for i, item in enumerate(scheduled):
            req, n = item.request, item.num_tokens
            sample_row = row + n - 1 if item.samples else None
            if item.is_wave:
                plans.append(SeqPlan(1, 1.0, 1, sample_row, False))
            else:
                decoding = n == 1 and item.first_token >= len(req.prompt_token_ids)
                plans.append(SeqPlan(req.num_loops, req.exit_threshold, req.params.min_loops, sample_row,
                                     decoding and self.layout.stops_early))
            if item.depth == 0:
                entering.append(i)
            if not item.is_wave or item.depth == req.num_loops - 1:
                finishing.append(i)
            starts.append(row)
            row += n

        state = self._enter(inputs.ids, ctx, scheduled, entering, starts)
        result = run_loops(model, state, ctx, plans)
        for i, item in enumerate(scheduled):           # segments with loops to go wait for the next step
            if item.is_wave and i not in finishing:
                key = (item.request.request_id, item.first_token)
                self.wave_states[key] = result.state[:, starts[i]:starts[i] + item.num_tokens]

        sample_seqs = [i for i, p in enumerate(plans) if p.sample_row is not None]
        sample_rows = [plans[i].sample_row for i in sample_seqs]
        final = result.state
        if result.sample_state is not None:
            final = final.index_copy(1, self._rows(sample_rows), result.sample_state)
        logits = None
        if fixed and len(finishing) < len(scheduled):
            # Huginn's coda writes KV: only rows that finished their loops may run it
            sub, rows_t = ctx.subset(finishing)
            finishing_rows = [r for i in finishing for r in range(starts[i], starts[i] + scheduled[i].num_tokens)]
            where = {r: k for k, r in enumerate(finishing_rows)}
            if finishing:
                local = self._rows([where[r] for r in sample_rows])
                logits = model.coda(final.index_select(1, rows_t), sub, rows=local)[0].float()
        elif sample_seqs or fixed:
            logits = model.coda(final, ctx, rows=self._rows(sample_rows))[0].float()     # [R, V]
        if result.exits and self.layout.fills_skipped:
            self.fill_skipped_planes(result.exits, scheduled, plans, blocks)
        loops = [scheduled[i].request.num_loops if scheduled[i].is_wave else n
                 for i, n in zip(sample_seqs, result.sample_loops)]
        requests = [scheduled[i].request for i in sample_seqs]
        # prompt logprobs (runtime/execution/logprobs.py): the coda on the chunk rows that predict prompt tokens
        wanted = prompt_rows(scheduled)
        prompt = (wanted, prompt_logits(model, result.state, ctx, wanted)) if wanted else None
        return logits if sample_seqs else None, requests, loops, row, prompt

    def _enter(self, ids: torch.Tensor, ctx, scheduled: Sequence[ScheduledRequest], entering: list[int],
               starts: list[int]) -> torch.Tensor:
        """The step's state `[1, T, X]`: the prelude of the entering rows, the saved states of the rest."""
        if len(entering) == len(scheduled):
            return self.model.prelude(ids, ctx)
        parts: list[torch.Tensor | None] = [None] * len(scheduled)
        if entering:
            sub, rows_t = ctx.subset(entering)
            entered = self.model.prelude(ids.index_select(1, rows_t), sub)                   # [1, Te, X]
            offset = 0
            for i in entering:
                n = scheduled[i].num_tokens
                parts[i] = entered[:, offset:offset + n]
                offset += n
        for i, item in enumerate(scheduled):
            if parts[i] is None:
                parts[i] = self.wave_states.pop((item.request.request_id, item.first_token))
        return torch.cat(parts, dim=1)

    def _rows(self, rows: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)

    def fill_skipped_planes(self, exits: list[tuple[int, int]], scheduled: Sequence[ScheduledRequest],
                            plans: Sequence[SeqPlan], blocks: BlockManager) -> None:
        """A token that stopped at its exit loop: copy its KV from the exit plane into every deeper plane."""
        bs = self.block_size
        src, dst = [], []
        for i, loop in exits:
            req = scheduled[i].request
            pos = req.num_computed_tokens                      # the decoding token's position
            tables = blocks.block_tables(req.request_id)
            slot = lambda plane: tables[plane][pos // bs] * bs + pos % bs
            exit_plane = self.layout.physical(self.kv_spec.num_fixed_planes + loop)
            for deeper in self.layout.skipped_planes(loop, plans[i].num_loops):
                src.append(slot(exit_plane))
                dst.append(slot(deeper))
        for cache in self.kv_caches:
            self.backend.copy_kv(cache, self._rows(src), self._rows(dst))
