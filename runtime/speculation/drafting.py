"""The draft side of self-speculative decoding: the model's first `draft_loops` loops and its head
propose tokens, one pass per position (see runtime/speculation/speculator.py for the round).

A draft pass over the tokens at position p+j of a batch of requests runs the prelude and loops
0..d-1 on one row per request (writing KV planes 0..d-1 and any fixed prelude plane at p+j), keeps
the state, and runs the head on the rows that still need a token. Greedy requests take the argmax;
sampling ones draw from their filtered distribution with a keyed uniform (runtime/speculation/acceptance.py),
and that distribution is kept for the acceptance test. No host sync: tokens stay on the device.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from runtime.execution.sampler import filtered_probs
from runtime.execution.step_inputs import SeqSlice, describe, place
from runtime.speculation.acceptance import DRAFT, coupled_tokens, keyed_uniforms, sample_with_uniform


class DraftBatch(NamedTuple):
    """One round's drafts for B requests; K = speculative.num_tokens, rows past a request's k are padding."""

    requests: list                    # runtime.engine.sequence.Request
    starts: list[int]                 # position of each request's first token t0 (computed this round)
    num_drafts: list[int]             # k per request (1 <= k <= K)
    tokens: torch.Tensor              # [B, K] int64: x1 .. xk
    states: torch.Tensor              # [B, K+1, X]: state after draft_loops loops at positions start .. start+k
    probs: torch.Tensor | None        # [B, K, V] float32: distributions sampled drafts were drawn from
    guess: torch.Tensor | None        # [B] int64: the draft's token after xk (async: next round's t0)

    @staticmethod
    def gather(picks: Sequence[tuple["DraftBatch", int]], num_drafts: Sequence[int]) -> "DraftBatch":
        """Rows `picks` of earlier draft batches, each cut to `num_drafts` drafts (on the device)."""
        parts = []
        for source in {id(d): d for d, _ in picks}.values():
            mine = [(i, row) for i, (d, row) in enumerate(picks) if d is source]
            rows = _long([row for _, row in mine], source.tokens.device)
            ks = [num_drafts[i] for i, _ in mine]
            tokens = source.tokens.index_select(0, rows)
            cut = torch.tensor([k < source.num_drafts[row] for (_, row), k in zip(mine, ks)])
            cut_at = torch.tensor(ks, dtype=torch.long)[:, None].to(tokens.device, non_blocking=True)
            # a shorter round's guess is the next draft token it did not verify
            guess = torch.where(cut.to(tokens.device, non_blocking=True), tokens.gather(1, cut_at.clamp(
                max=tokens.shape[1] - 1))[:, 0], source.guess.index_select(0, rows))
            probs = None if source.probs is None else source.probs.index_select(0, rows)
            parts.append(DraftBatch([source.requests[row] for _, row in mine],
                                    [source.starts[row] for _, row in mine], ks, tokens,
                                    source.states.index_select(0, rows), probs, guess))
        return parts[0] if len(parts) == 1 else DraftBatch.concat(parts)

    @staticmethod
    def concat(parts: Sequence["DraftBatch"]) -> "DraftBatch":
        probs = None
        if any(p.probs is not None for p in parts):
            like = next(p.probs for p in parts if p.probs is not None)
            probs = torch.cat([p.probs if p.probs is not None else like.new_zeros(len(p.requests), *like.shape[1:])
                               for p in parts])
        guess = None if any(p.guess is None for p in parts) else torch.cat([p.guess for p in parts])
        return DraftBatch([r for p in parts for r in p.requests], [s for p in parts for s in p.starts],
                          [k for p in parts for k in p.num_drafts], torch.cat([p.tokens for p in parts]),
                          torch.cat([p.states for p in parts]), probs, guess)


def draft_stages(model, draft_loops: int, ids: torch.Tensor, ctx, rows: torch.Tensor | None = None):
    """A draft pass: the prelude and loops 0..d-1 over `ids: [1, R]`, then the head on `rows` (all
    rows when None). Returns the state `[1, R, X]` and the logits `[H, V]` float32."""
    state = model.prelude(ids, ctx)
    for depth in range(draft_loops):
        state = model.loop(state, depth, ctx)
    return state, model.coda(state, ctx, rows=rows)[0].float()


def draft_tokens(runner, requests: list, first_tokens: torch.Tensor, starts: list[int], num_drafts: list[int],
                 blocks, draft_loops: int, max_drafts: int, with_guess: bool, use_graphs: bool = True) -> DraftBatch:
    """Draft `num_drafts[b]` tokens after `first_tokens: [B]` (at positions `starts`) for each request,
    in max(num_drafts) + 1 passes; with `with_guess` the last pass of a request runs the head too.
    With `use_graphs` (and a runner that captures) every pass replays a captured graph."""
    env, num_seqs = runner.env, len(requests)
    device = env.device
    planes = env.layout.num_fixed_planes + draft_loops       # the only planes a draft pass touches
    tables = [blocks.block_tables(r.request_id)[:planes] for r in requests]
    graphs = runner.graphs if use_graphs else None
    model = runner.model        # the captured program keeps `model`, not the runner that keeps the program
    tokens = torch.zeros(num_seqs, max_drafts, dtype=torch.long, device=device)
    guess = torch.zeros(num_seqs, dtype=torch.long, device=device) if with_guess else None
    states = probs = None
    current = first_tokens.clone()                                                  # [B]
    for j in range(max(num_drafts) + 1):
        active = [b for b in range(num_seqs) if num_drafts[b] >= j]
        host = describe([SeqSlice(requests[b], starts[b] + j, 1, tables[b]) for b in active], planes,
                        env.block_size, with_tokens=False)
        ids = current.index_select(0, _long(active, device))                                  # [R]
        heads = [i for i, b in enumerate(active) if j < num_drafts[b] or with_guess]
        if graphs is not None and graphs.bucket(len(active)) is not None:
            key = ("draft", graphs.bucket(len(active)), draft_loops)
            program = lambda x, ctx: draft_stages(model, draft_loops, x, ctx)       # noqa: E731
            state, logits = graphs.run(key, program, host, 1, planes, ids)          # [1, B, X], [B, V]
            state = state[:, :len(active)]
            logits = logits.index_select(0, _long(heads, device)) if heads else None
        else:
            ctx = place(env, host, ids=ids).ctx
            state, logits = draft_stages(model, draft_loops, ids[None], ctx, _long(heads, device))
        state = state[0]
        if states is None:
            states = state.new_empty(num_seqs, max_drafts + 1, state.shape[-1])
        states[_long(active, device), j] = state
        if not heads:
            continue
        rows = [active[i] for i in heads]
        picked, sampled, dist = pick_tokens(logits, [requests[b] for b in rows], [starts[b] + j + 1 for b in rows])
        current.index_copy_(0, _long(rows, device), picked)
        drafting = [i for i, b in enumerate(rows) if j < num_drafts[b]]
        if drafting:
            tokens[_long([rows[i] for i in drafting], device), j] = picked.index_select(0, _long(drafting, device))
        guessing = [i for i, b in enumerate(rows) if j == num_drafts[b]]
        if guessing:
            guess[_long([rows[i] for i in guessing], device)] = picked.index_select(0, _long(guessing, device))
        keep = [(s, rows[i]) for s, i in enumerate(sampled) if j < num_drafts[rows[i]]]
        if keep:
            if probs is None:
                probs = logits.new_zeros(num_seqs, max_drafts, logits.shape[-1])
            kept = dist.index_select(0, _long([s for s, _ in keep], device))
            probs[_long([b for _, b in keep], device), j] = kept
    return DraftBatch(list(requests), list(starts), list(num_drafts), tokens, states, probs, guess)


def round_program(model, draft_loops: int, num_loops: int, num_drafts: int, bucket: int, advance: bool):
    """A whole greedy round as one program over `bucket` sequences (`PassGraphs.run_chain`): K = `num_drafts`
    draft passes and the pass over xK (one row per sequence), each pass's argmax the next pass's input
    on the device, then the verify pass from their states. The passes are `draft_stages` and
    `verify_stages` themselves, so the tokens are the per-pass round's. Contexts: with `advance`
    [draft pass 0, verify], pass j's context advanced j positions on the device from pass 0's
    (`PagedContext.advanced`); else [draft pass 0 .. K, verify], each filled by the host. Returns
    `[bucket, 2K+1]` int64: the drafts x1..xK, then the target's argmax after each of the K+1 prefixes."""
    from runtime.speculation.speculator import verify_stages

    def run(ids: torch.Tensor, ctxs: list) -> torch.Tensor:
        states, drafts = [], []
        for j in range(num_drafts + 1):
            ctx = ctxs[j] if not advance else ctxs[0] if j == 0 else ctxs[0].advanced(j)
            if j < num_drafts:
                state, logits = draft_stages(model, draft_loops, ids, ctx)
                drafts.append(logits.argmax(-1))                                   # [bucket]
                ids = drafts[-1][None]
            else:                        # the pass over xK only makes its state: no head
                state = model.prelude(ids, ctx)
                for depth in range(draft_loops):
                    state = model.loop(state, depth, ctx)
            states.append(state[0])
        states = torch.stack(states, 1).flatten(0, 1)[None]                        # [1, bucket*(K+1), X]
        targets = verify_stages(model, draft_loops, num_loops, states, ctxs[-1]).argmax(-1)
        return torch.cat([torch.stack(drafts, 1), targets.view(bucket, num_drafts + 1)], 1)
    return run


def pick_tokens(logits: torch.Tensor, requests: list, positions: list[int]
                ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """Draft tokens `[H]` from `logits: [H, V]`; also the rows that sampled and their distributions `[S, V]`.
    A seeded request drafts with the plain sampler's noise at the position (`coupled_tokens`), so its
    drafts are the tokens its target will sample whenever the two distributions agree enough."""
    picked = logits.argmax(-1)
    sampled = [i for i, r in enumerate(requests) if not r.params.is_greedy]
    if not sampled:
        return picked, sampled, None
    dist = torch.stack([filtered_probs(logits[i], requests[i].params) for i in sampled])
    seeded = [s for s, i in enumerate(sampled) if requests[i].params.seed is not None]
    unseeded = [s for s, i in enumerate(sampled) if requests[i].params.seed is None]
    if unseeded:
        u = keyed_uniforms([requests[sampled[s]].speculation.seed for s in unseeded],
                           [[positions[sampled[s]]] for s in unseeded], DRAFT, logits.device)[:, 0]
        rows = _long(unseeded, logits.device)
        picked[_long([sampled[s] for s in unseeded], logits.device)] = sample_with_uniform(
            dist.index_select(0, rows), u)
    if seeded:
        rows = _long(seeded, logits.device)
        picked[_long([sampled[s] for s in seeded], logits.device)] = coupled_tokens(
            dist.index_select(0, rows), [requests[sampled[s]].params.seed for s in seeded],
            [positions[sampled[s]] for s in seeded])
    return picked, sampled, dist


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    # non_blocking: a host-to-device copy from pageable memory is staged at once and does not wait
    # for the stream's earlier work, so issuing a pass never stalls on the previous one
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
