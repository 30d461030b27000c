"""Wavefront chunked prefill: one step whose rows sit at different loop depths.

Standard chunked prefill runs each chunk of a long prompt through every loop before the next chunk
starts: per step, `num_loops` loop calls over one chunk. Under the wavefront, chunk i runs loop k
in the same step as chunk i+1 runs loop k-1, and since a looped model applies the *same weights*
at every depth, all of them go through one loop call (one set of matmuls over all their rows).
Chunk i+1 at loop k-1 needs chunk i's KV at plane k-1, which chunk i wrote one step earlier.

How a mixed-depth call works without touching the model or the attention backend: the model runs
`loop(state, 0, ctx)`, and the step's `PagedBatch` hands each sequence its block table of plane
`fixed + depth` where the model asks for plane `fixed + 0` (the tables are shifted per sequence).
This relies on the looped-model contract: a loop's computation depends on its depth only through
the KV plane it reads and writes (true for Ouro, Huginn and Nanbeige).

The step's items (runtime/engine/scheduler.py `ScheduledRequest`) are standard ones (all loops; decodes
and whole prompts) and wave segments (`is_wave`: one loop at `depth`). Rows that enter (depth 0)
run the prelude; a wave segment's state waits in `runner.wave_states` between steps; rows that
finish their last loop run the coda (Huginn's coda writes KV, so only those).
"""
from __future__ import annotations

from typing import Sequence

import torch

from hal.base import PagedBatch
from runtime.execution.async_step import PendingStep, StepResult, feed_tokens
from runtime.execution.context import PagedContext
from runtime.engine.kv_cache import BlockManager
from runtime.execution.loops import SeqPlan, run_loops
from runtime.engine.scheduler import ScheduledRequest
from runtime.engine.sequence import PLACEHOLDER


def shifted_tables(tables: list[list[int]], num_fixed_planes: int, shift: int) -> list[list[int]]:
    """A request's tables `[plane][block]` as seen by a row at loop `shift` that the model runs as
    loop 0: loop plane `fixed + d` shows the blocks of plane `fixed + d + shift`."""
    if not shift:
        return tables
    return [tables[p] if p < num_fixed_planes else (tables[p + shift] if p + shift < len(tables) else [])
            for p in range(len(tables))]


def _subset_rows(starts: list[int], lens: list[int], seqs: Sequence[int]) -> list[int]:
    return [r for i in seqs for r in range(starts[i], starts[i] + lens[i])]


def execute_wave(runner, scheduled: Sequence[ScheduledRequest], blocks: BlockManager,
                 input_ids_from_device: PendingStep | None, deferred: bool) -> StepResult | PendingStep:
    """`ModelRunner.execute` for a step with wave segments (same arguments and results)."""
    model, fixed, device = runner.model, runner.kv_spec.num_fixed_planes, runner.device
    token_ids, positions, plans, starts, lens, seq_lens, tables, fed = [], [], [], [], [], [], [], []
    entering, finishing = [], []
    row = 0
    for i, item in enumerate(scheduled):
        req, n, start = item.request, item.num_tokens, item.first_token
        token_ids.extend(req.all_token_ids[start:start + n])
        if token_ids[-1] == PLACEHOLDER:
            fed.append((row + n - 1, req.request_id))
        positions.extend(range(start, start + n))
        starts.append(row)
        lens.append(n)
        seq_lens.append(start + n)
        shift = item.depth if item.is_wave else 0
        tables.append(shifted_tables(blocks.block_tables(req.request_id), fixed, shift))
        sample_row = row + n - 1 if item.samples else None
        if item.is_wave:
            plans.append(SeqPlan(1, 1.0, 1, sample_row, False))
        else:
            decoding = n == 1 and start >= len(req.prompt_token_ids)
            plans.append(SeqPlan(req.num_loops, req.exit_threshold, req.params.min_loops, sample_row,
                                 decoding and runner.config.kv_mode != "full"))
        if item.depth == 0:
            entering.append(i)
        if not item.is_wave or item.depth == req.num_loops - 1:
            finishing.append(i)
        row += n
    num_planes = max(len(t) for t in tables)
    by_plane = [[t[p] if p < len(t) else [] for t in tables] for p in range(num_planes)]
    batch = PagedBatch(lens, seq_lens, by_plane, runner.block_size)
    ids = feed_tokens(token_ids, fed, input_ids_from_device, device)[None]
    pos = torch.tensor(positions, dtype=torch.long, device=device)[None]
    ctx = PagedContext(runner.backend, runner.kv_caches, batch, pos, runner.config.kv_mode, fixed,
                       runner._initial_state_fn(scheduled))

    state = _enter(runner, ctx, ids, scheduled, entering, starts, lens)
    result = run_loops(model, state, ctx, plans)
    for i, item in enumerate(scheduled):           # chunks with loops to go wait for the next step
        if item.is_wave and i not in finishing:
            runner.wave_states[(item.request.request_id, item.first_token)] = \
                result.state[:, starts[i]:starts[i] + lens[i]]

    sample_seqs = [i for i, p in enumerate(plans) if p.sample_row is not None]
    final = result.state
    sample_rows = [plans[i].sample_row for i in sample_seqs]
    if result.sample_state is not None:
        rows_t = torch.tensor(sample_rows, dtype=torch.long, device=device)
        final = final.index_copy(1, rows_t, result.sample_state)
    logits = None
    if fixed and len(finishing) < len(scheduled):
        # the coda writes KV: run it on the finishing rows only
        rows = _subset_rows(starts, lens, finishing)
        sub, rows_t = ctx.subset(finishing)
        where = {r: k for k, r in enumerate(rows)}
        local = torch.tensor([where[r] for r in sample_rows], dtype=torch.long, device=device)
        if finishing:
            logits = model.coda(final.index_select(1, rows_t), sub, rows=local)[0].float()
    elif sample_seqs or fixed:
        rows_t = torch.tensor(sample_rows, dtype=torch.long, device=device)
        logits = model.coda(final, ctx, rows=rows_t)[0].float()
    if result.exits and runner.config.kv_mode == "last_exited":
        runner._fill_skipped_planes(result.exits, scheduled, plans, blocks)
    loops = [scheduled[i].request.num_loops if scheduled[i].is_wave else n
             for i, n in zip(sample_seqs, result.sample_loops)]
    requests = [scheduled[i].request for i in sample_seqs]
    return runner.finish_step(logits if sample_seqs else None, requests, loops, row, deferred)


def _enter(runner, ctx: PagedContext, ids: torch.Tensor, scheduled: Sequence[ScheduledRequest],
           entering: list[int], starts: list[int], lens: list[int]) -> torch.Tensor:
    """The step's state `[1, T, X]`: the prelude of the entering rows, the saved states of the rest."""
    model = runner.model
    if len(entering) == len(scheduled):
        return model.prelude(ids, ctx)
    parts: list[torch.Tensor | None] = [None] * len(scheduled)
    if entering:
        sub, rows_t = ctx.subset(entering)
        sub.initial_state = runner._initial_state_fn([scheduled[i] for i in entering])
        entered = model.prelude(ids.index_select(1, rows_t), sub)                  # [1, Te, X]
        offset = 0
        for i in entering:
            parts[i] = entered[:, offset:offset + lens[i]]
            offset += lens[i]
    for i, item in enumerate(scheduled):
        if parts[i] is None:
            parts[i] = runner.wave_states.pop((item.request.request_id, item.first_token))
    return torch.cat(parts, dim=1)
