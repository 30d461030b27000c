"""The loop controller: how deep each token of a step runs, and which loop its logits come from.

Every sequence of a step runs `num_loops` loops (its request's setting). With an exit threshold
below 1 (Ouro's gate) the logits of a sampled token come from the first loop whose cumulative
exit probability reaches the threshold (never before `min_loops`). Whether a decoding token then
really stops there (`SeqPlan.can_stop_early`) is the KV layout's answer (runtime/engine/planes.py);
tokens that did are reported in `exits`, so the runner can fill the planes they skipped.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch

from zoo.base import LoopedCausalLM, exit_distribution, first_exit_step


class SeqPlan(NamedTuple):
    num_loops: int
    exit_threshold: float
    min_loops: int
    sample_row: int | None      # packed row of the token whose logits are wanted, if any
    can_stop_early: bool        # a decoding token in a mode that skips the loops after its exit


class LoopResult(NamedTuple):
    state: torch.Tensor                     # [1, T, X] after each sequence's last loop
    sample_state: torch.Tensor | None       # [1, R, X] the rows to take logits from, in sample order
    sample_loops: list[int]                 # loops behind each sampled token's logits
    exits: list[tuple[int, int]]            # (sequence, loop) of tokens that stopped before their last loop


def _may_exit(pdf: torch.Tensor, loops: torch.Tensor, threshold: torch.Tensor, min_loops: torch.Tensor,
              last: torch.Tensor) -> torch.Tensor:
    """`[R, L]`: where a row's logits may come from: its cumulative exit probability reached its
    threshold and not before `min_loops`, or its last loop (also where min_loops is past it)."""
    reached = torch.cumsum(pdf, dim=-1) >= threshold[:, None]
    return (reached & (loops[None, :] >= min_loops[:, None] - 1)) | last


def _first_reaching(hazards: list[torch.Tensor], threshold: torch.Tensor, min_loops: torch.Tensor,
                    num_loops: torch.Tensor) -> torch.Tensor:
    """Per row, the first loop (0-based) whose cumulative exit probability reaches its threshold,
    among the loops seen so far; -1 where none has yet. Uses the same ops as the reference path
    (`exit_distribution` / cumsum) so the decisions match it bit for bit."""
    stacked = torch.stack(hazards, dim=-1)                              # [R, L]
    survive = torch.cumprod(1 - stacked, dim=-1)
    reached = torch.cat([torch.ones_like(survive[:, :1]), survive[:, :-1]], dim=-1)
    pdf = stacked * reached
    loops = torch.arange(stacked.shape[-1], device=stacked.device)
    # a row's last loop takes all remaining probability
    last = loops[None, :] == (num_loops[:, None] - 1)
    pdf = torch.where(last, reached, pdf)
    ok = _may_exit(pdf, loops, threshold, min_loops, last)
    first = torch.where(ok, loops[None, :], torch.full_like(ok, stacked.shape[-1], dtype=torch.long)).min(-1).values
    return torch.where(first < stacked.shape[-1], first, torch.full_like(first, -1))


def run_loops(model: LoopedCausalLM, state: torch.Tensor, ctx, plans: Sequence[SeqPlan],
              first_loop: int = 0) -> LoopResult:
    """Run every sequence's loops over the packed `state: [1, T, X]` (see the module docstring).
    `first_loop > 0` continues a state that already ran the loops before it (speculative
    verification continues the draft's state); exit gates are not evaluated then."""
    num_seqs = len(plans)
    sample_seqs = [i for i, p in enumerate(plans) if p.sample_row is not None]
    device = state.device
    sample_rows = torch.tensor([plans[i].sample_row for i in sample_seqs], dtype=torch.long, device=device)
    gated = [i for i in sample_seqs if plans[i].exit_threshold < 1.0]
    assert not (gated and first_loop), "early exit needs the exit gate of every loop"
    # a row at threshold 1 runs all its loops (float32 rounding can bring its cumulative exit
    # probability to 1.0 before the last loop), as the reference path computes no exit for it
    threshold = torch.tensor([plans[i].exit_threshold if plans[i].exit_threshold < 1.0 else math.inf
                              for i in sample_seqs], device=device)
    min_loops = torch.tensor([plans[i].min_loops for i in sample_seqs], device=device)
    num_loops = torch.tensor([plans[i].num_loops for i in sample_seqs], device=device)

    active = list(range(num_seqs))
    hazards: list[torch.Tensor] = []
    sample_states: list[torch.Tensor] = []
    exits: list[tuple[int, int]] = []
    stopped_at: dict[int, int] = {}
    for depth in range(first_loop, max(p.num_loops for p in plans)):
        running = [i for i in active if plans[i].num_loops > depth]
        if not running:
            break
        if len(running) == num_seqs:
            state = model.loop(state, depth, ctx)
        else:
            sub, rows = ctx.subset(running)
            state = state.index_copy(1, rows, model.loop(state.index_select(1, rows), depth, sub))
        if not gated:
            continue
        rows_now = state.index_select(1, sample_rows)                   # [1, R, X]
        hazard = model.exit_hazard(rows_now)
        if hazard is None:
            gated = []
            continue
        hazards.append(hazard[0].float())
        sample_states.append(rows_now)
        early = [i for i in running if plans[i].can_stop_early and plans[i].exit_threshold < 1.0
                 and depth < plans[i].num_loops - 1]
        if early:
            first = _first_reaching(hazards, threshold, min_loops, num_loops).tolist()   # host sync
            for i in early:
                if first[sample_seqs.index(i)] == depth:
                    active.remove(i)
                    exits.append((i, depth))
                    stopped_at[i] = depth

    if not hazards:
        loops = [plans[i].num_loops for i in sample_seqs]
        return LoopResult(state, None, loops, exits)
    # logits of each sampled token from its exit loop (all loops of full-mode tokens ran)
    chosen = torch.tensor([stopped_at.get(i, -1) for i in sample_seqs], device=device)
    full = torch.stack(hazards, -1)
    pdf = exit_distribution(full)
    selected = torch.where(chosen >= 0, chosen, first_exit_step_bounded(pdf, threshold, min_loops, num_loops))
    stacked = torch.cat(sample_states, dim=0)                            # [L, R, X]
    sample_state = stacked.gather(0, selected[None, :, None].expand(1, *stacked.shape[1:]))
    return LoopResult(state, sample_state, (selected + 1).tolist(), exits)


def exit_loops(hazards: Sequence[torch.Tensor], threshold: torch.Tensor, min_loops: torch.Tensor) -> torch.Tensor:
    """`[R]` int64: per row, the 0-based loop whose state gives its logits, where every row ran all
    `len(hazards)` loops (a decode step in a KV mode that does not stop early): `run_loops`'s choice
    (`first_exit_step_bounded`) from device values alone, so a captured pass can make it.
    `hazards`: one `[R]` float32 per loop; `threshold: [R]` float32 (inf: the last loop);
    `min_loops: [R]` int64."""
    pdf = exit_distribution(torch.stack(list(hazards), dim=-1))
    loops = torch.arange(pdf.shape[-1], device=pdf.device)
    last = (loops == pdf.shape[-1] - 1)[None, :]
    return _may_exit(pdf, loops, threshold, min_loops, last).int().argmax(dim=-1)


def first_exit_step_bounded(pdf: torch.Tensor, threshold: torch.Tensor, min_loops: torch.Tensor,
                            num_loops: torch.Tensor) -> torch.Tensor:
    """`zoo.base.first_exit_step` per row with its own threshold, min_loops and loop count.
    `pdf: [R, L]` over the loops that ran (rows with fewer loops are padded past their end)."""
    if bool((num_loops == pdf.shape[-1]).all()) and bool((min_loops <= 1).all()) and threshold.unique().numel() == 1:
        return first_exit_step(pdf, float(threshold[0]))
    loops = torch.arange(pdf.shape[-1], device=pdf.device)
    last = loops[None, :] == (num_loops[:, None] - 1)
    ok = _may_exit(pdf, loops, threshold, min_loops, last) & (loops[None, :] < num_loops[:, None])
    return ok.int().argmax(dim=-1)
