"""The forward programs that passes run, captured or eager over static buffers: a prefill (the head
on chosen rows), a decode step (the head on every row), each with early exit where every loop runs
anyway (kv_mode=full): the state each sampled row exits at, chosen on the device by the eager pass's
rule (`loops.exit_loops`), so a captured pass needs no host read of the gates."""
from __future__ import annotations

from typing import NamedTuple

import torch

from hal.common.staging import StagingRing
from runtime.execution.loops import exit_loops
from zoo.base import LoopedCausalLM


class ExitRows(NamedTuple):
    """Static per-row early-exit settings of a captured pass (its sampled rows in order, then padding
    at the last loop), refilled through pinned mirrors (no copy waits for a replay)."""
    threshold: torch.Tensor      # [R] float32; inf: the row takes its last loop
    min_loops: torch.Tensor      # [R] int64
    staging: StagingRing


def loops_to_exit(model: LoopedCausalLM, state: torch.Tensor, ctx, num_loops: int, exits: ExitRows,
                  rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every loop over `state: [1, T, X]`, where every loop runs anyway (kv_mode=full): the state of
    each row of `rows` (all rows when None) at its exit loop, chosen on the device by the eager pass's
    rule (`loops.exit_loops`) -> (`[1, R, X]`, the loops behind them `[R]`)."""
    states, hazards = [], []
    for depth in range(num_loops):
        state = model.loop(state, depth, ctx)
        rows_now = state if rows is None else state.index_select(1, rows)             # [1, R, X]
        states.append(rows_now)
        hazards.append(model.exit_hazard(rows_now)[0].float())                         # [R]
    chosen = exit_loops(hazards, exits.threshold, exits.min_loops)                     # [R]
    stacked = torch.cat(states, dim=0)                                                 # [L, R, X]
    return stacked.gather(0, chosen[None, :, None].expand(1, *stacked.shape[1:])), chosen + 1


def prefill_program(model: LoopedCausalLM, num_loops: int, sample_rows: torch.Tensor | None,
                    exits: ExitRows | None = None):
    """A pass: prelude, every loop, the head on rows `sample_rows` (a static buffer: `[1]`, one
    prompt's last real token; `[S]`, each sequence's last row of a packed step; None: every row) ->
    logits `[R, V]` float32; with `exits` the rows' logits come from their exit loops -> (logits, the
    loops behind them `[R]`)."""
    def run(ids: torch.Tensor, ctx) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        state = model.prelude(ids, ctx)
        if exits is not None:
            picked, loops = loops_to_exit(model, state, ctx, num_loops, exits, rows=sample_rows)
            return model.coda(picked, ctx)[0].float(), loops
        for depth in range(num_loops):
            state = model.loop(state, depth, ctx)
        return model.coda(state, ctx, rows=sample_rows)[0].float()
    return run


def with_loops(out, exits: ExitRows | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A program's output as (logits, the loops behind them or None: every row ran all of them)."""
    return out if exits is not None else (out, None)


def decode_program(model: LoopedCausalLM, num_loops: int, exits: ExitRows | None = None):
    """A decode pass: the head on every row -> logits `[B, V]` float32 (with `exits`: and the loops
    behind them `[B]`)."""
    return prefill_program(model, num_loops, None, exits)
