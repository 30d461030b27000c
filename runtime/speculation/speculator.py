"""Self-speculative decoding: a looped model drafts with its own first loops, then verifies the draft
at full depth in one pass that continues from the draft's state.

One round for a decoding request whose last token t0 (position p) is not yet computed, with k
drafts, d = draft_loops and D = the request's loops:
  draft    k + 1 passes over t0, x1, .., xk (positions p .. p+k): the prelude and loops 0..d-1,
           writing KV planes 0..d-1 (and Huginn's prelude plane); the first k passes also run the
           head (Ouro, Nanbeige: lm_head after loop d-1; Huginn: the coda) to pick x1 .. xk. Each
           token's state after loop d-1 is kept.
  verify   one pass over the k + 1 positions that starts from those states: loops d..D-1 and the
           head, writing planes d..D-1 (and Huginn's coda KV). A token's first d loops are the same
           computation for draft and target, so they are never repeated.
  accept   runtime/speculation/acceptance.py: n drafts kept, n + 1 tokens committed, the computed tokens
           become p + n + 1.
  rollback positions p+n+1 .. p+k hold rejected tokens' KV in every plane. They lie at or beyond
           the computed tokens, and every pass writes a position's KV in each plane it reads before
           attending to it, so later steps overwrite them before anything reads them. The block
           tables are trimmed to the computed tokens.
Async mode: once a round's draft is issued, the next round's draft is issued on a second stream,
assuming every draft is kept and the target's next token equals the draft's own guess (the head of
the pass over xk). When the verdict confirms both, the next round skips its draft; otherwise that
work is dropped (its KV lies beyond the computed tokens, as above). The outputs are the sync mode's.
Fused: a sync round of greedy requests runs as one captured graph (runtime/speculation/fused_round.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from runtime.config import SpeculativeConfig
from runtime.engine.kv_cache import BlockManager
from runtime.engine.sequence import Request
from runtime.engine.step_schedule import ScheduledRequest
from runtime.execution.loops import SeqPlan, run_loops
from runtime.execution.step_inputs import SeqSlice, describe, place
from runtime.speculation.acceptance import RoundVerdict, judge_round
from runtime.speculation.drafting import DraftBatch, draft_tokens
from runtime.speculation.fused_round import FusedRound


class SpecResult(NamedTuple):
    committed: dict[str, list[int]]     # request id -> accepted drafts + the target's token
    num_tokens: int                     # positions the verify pass computed


@dataclass
class RequestSpecState:
    seed: int                           # keys the request's random numbers (runtime/speculation/acceptance.py)
    ahead: "Ahead | None" = None        # the next round's draft, made in advance (async)


class Ahead(NamedTuple):
    draft: DraftBatch                   # holds this request at `row`
    row: int
    position: int                       # the round's first position (t0)
    num_preemptions: int                # the request's count when it was drafted


@dataclass
class SpecCounters:
    """Work done: token-loops (one loop applied to one token: compute) and loop passes (one loop
    applied to a whole batch: one read of the loop weights), drafts and verifies apart."""

    num_rounds: int = 0                  # engine steps with a speculation round
    num_committed: int = 0               # tokens those rounds committed (before stop truncation)
    num_draft_token_loops: int = 0
    num_verify_token_loops: int = 0
    num_draft_loop_passes: int = 0
    num_verify_loop_passes: int = 0


class Speculator(FusedRound):
    def __init__(self, runner, config: SpeculativeConfig) -> None:
        self.runner, self.config = runner, config
        self.model, self.hal = runner.model, runner.hal
        self.is_async = config.mode == "async"
        self.side_stream = self.hal.stream() if self.is_async else None
        self.side_done = None            # event after the last work issued on the side stream
        self.counters = SpecCounters()
        self.advances: bool | None = None  # the backend advances decode metadata on the device (decided at first use)

    # ----- one round for every speculating request of a step ------------------------------
    @torch.inference_mode()
    def run(self, items: Sequence[ScheduledRequest], blocks: BlockManager) -> SpecResult:
        requests = [item.request for item in items]
        num_drafts = [item.num_draft_tokens for item in items]
        if self._fusable(requests, num_drafts) and self._room_for_k(requests, num_drafts, blocks):
            for request in requests:
                self.state_of(request)
            return self._finish(*self._fused_round(requests, blocks, num_drafts), None, blocks)
        ready = [self._usable_ahead(r, k) for r, k in zip(requests, num_drafts)]
        parts = []
        fresh = [i for i, a in enumerate(ready) if a is None]
        if fresh:
            first = self._tensor([requests[i].all_token_ids[-1] for i in fresh])
            starts = [requests[i].num_computed_tokens for i in fresh]
            parts.append(self._draft([requests[i] for i in fresh], first, starts, [num_drafts[i] for i in fresh],
                                     blocks))
        if len(fresh) < len(items):
            self.hal.current_stream().wait_event(self.side_done)
            parts.append(DraftBatch.gather([(a.draft, a.row) for a in ready if a is not None],
                                           [k for k, a in zip(num_drafts, ready) if a is not None]))
        draft = parts[0] if len(parts) == 1 else DraftBatch.concat(parts)
        drafted = self.hal.event()
        drafted.record()
        logits = self.verify(draft, blocks)
        ahead = self._draft_ahead(draft, blocks, drafted) if self.is_async else None
        return self._finish(draft, judge_round(draft, logits), ahead, blocks)

    def _finish(self, draft, verdict: RoundVerdict, ahead, blocks: BlockManager) -> SpecResult:
        """Commit a round's verdict: the tokens per request, metrics, async's draft ahead, trimmed tables."""
        drafts, num_accepted, finals, guesses = verdict
        committed, counters = {}, self.counters
        for b, request in enumerate(draft.requests):
            k, n = draft.num_drafts[b], num_accepted[b]
            tokens = drafts[b][:n] + [finals[b]]
            committed[request.request_id] = tokens
            state = request.speculation
            keep = ahead is not None and b in ahead[1] and n == k and guesses[b] == finals[b]
            state.ahead = Ahead(ahead[0], ahead[1][b], draft.starts[b] + k + 1,
                                request.metrics.num_preemptions) if keep else None
            held = request.num_computed_tokens + len(tokens)           # the computed tokens after the round
            if keep:
                held = max(held, state.ahead.position + ahead[0].num_drafts[state.ahead.row] + 1)
            blocks.trim(request.request_id, held)
            request.metrics.num_spec_rounds += 1
            request.metrics.num_draft_tokens += k
            request.metrics.num_accepted_tokens += n
            counters.num_committed += len(tokens)
        counters.num_rounds += 1
        if self.side_done is not None:
            # later work on the main stream (which may reuse trimmed blocks) waits for the side stream
            self.hal.current_stream().wait_event(self.side_done)
        return SpecResult(committed, sum(k + 1 for k in draft.num_drafts))

    # ----- a request's speculation state --------------------------------------------------------
    def state_of(self, request: Request) -> RequestSpecState:
        """The request's speculation state, made at its first round."""
        if request.speculation is None:
            request.speculation = RequestSpecState(self._seed(request))
        return request.speculation

    def _usable_ahead(self, request: Request, num_drafts: int) -> Ahead | None:
        ahead = self.state_of(request).ahead
        request.speculation.ahead = None
        if (ahead is None or ahead.position != request.num_computed_tokens
                or ahead.num_preemptions != request.metrics.num_preemptions
                or ahead.draft.num_drafts[ahead.row] < num_drafts):
            return None
        return ahead

    def _seed(self, request: Request) -> int:
        if request.params.seed is not None:
            return int(request.params.seed)
        return int(torch.randint(0, 2**62, (1,)))          # the global RNG, as unseeded sampling uses

    # ----- the passes -------------------------------------------------------------------------
    def _draft(self, requests: list[Request], first_tokens: torch.Tensor, starts: list[int],
               num_drafts: list[int], blocks: BlockManager, use_graphs: bool = True) -> DraftBatch:
        draft = draft_tokens(self.runner, requests, first_tokens, starts, num_drafts, blocks,
                             self.config.draft_loops, self.config.num_tokens, self.is_async, use_graphs)
        self.counters.num_draft_loop_passes += (max(num_drafts) + 1) * self.config.draft_loops
        self.counters.num_draft_token_loops += sum(k + 1 for k in num_drafts) * self.config.draft_loops
        return draft

    def verify(self, draft: DraftBatch, blocks: BlockManager) -> torch.Tensor:
        """Target logits `[N, V]` (float32) of the k + 1 positions of every request, packed."""
        env, model, first = self.runner.env, self.model, self.config.draft_loops
        self.counters.num_verify_loop_passes += max(r.num_loops for r in draft.requests) - first
        self.counters.num_verify_token_loops += sum((k + 1) * (r.num_loops - first)
                                                    for k, r in zip(draft.num_drafts, draft.requests))
        tables = [blocks.block_tables(r.request_id) for r in draft.requests]
        slices = [SeqSlice(r, s, k + 1, t) for r, s, k, t in zip(draft.requests, draft.starts, draft.num_drafts, tables)]
        num_planes = max(len(t) for t in tables)
        host = describe(slices, num_planes, env.block_size, with_tokens=False)
        width = draft.states.shape[1]
        graphs, loops = self.runner.graphs, draft.requests[0].num_loops
        uniform = (all(k + 1 == width for k in draft.num_drafts) and all(r.num_loops == loops for r in draft.requests))
        if graphs is not None and uniform and graphs.bucket(len(slices)) is not None:
            # a uniform round (every request at K drafts and the same depth): one captured pass
            key = ("verify", graphs.bucket(len(slices)), first, loops)
            program = lambda states, ctx: verify_stages(model, first, loops, states, ctx)    # noqa: E731
            logits = graphs.run(key, program, host, width, num_planes, draft.states.flatten(0, 1),
                                state_width=draft.states.shape[-1])
            return logits[:host.num_tokens]
        rows = [b * width + j for b, k in enumerate(draft.num_drafts) for j in range(k + 1)]
        state = draft.states.flatten(0, 1).index_select(0, self._tensor(rows))[None]       # [1, N, X]
        ctx = place(env, host, ids=self._tensor([0] * host.num_tokens)).ctx
        plans = [SeqPlan(r.num_loops, 1.0, 1, None, False) for r in draft.requests]
        state = run_loops(model, state, ctx, plans, first_loop=first).state
        return model.coda(state, ctx)[0].float()

    def _draft_ahead(self, draft: DraftBatch, blocks: BlockManager,
                     drafted) -> tuple[DraftBatch, dict[int, int]] | None:
        """Async: issue the next round's draft on the side stream, as if every draft were kept and
        the target's next token were the draft's guess. Returns it and {row in `draft`: its row}."""
        rows, nexts = [], []
        for b, request in enumerate(draft.requests):
            k = draft.num_drafts[b]
            start = draft.starts[b] + k + 1
            room = min(request.params.max_tokens - len(request.output_token_ids),
                       request.max_seq_len - request.num_tokens) - (k + 1)
            num_next = min(self.config.num_tokens, room - 1)
            needed = start + num_next + 1
            if num_next < 1 or not blocks.can_allocate(request.request_id, request.num_planes, needed):
                continue
            blocks.allocate(request.request_id, request.num_planes, needed)
            rows.append(b)
            nexts.append(num_next)
        if not rows:
            return None
        # Huginn's draft head reads the coda KV that the verify pass rewrites: wait for it there
        wait_for = drafted
        if self.runner.kv_spec.num_fixed_planes:
            wait_for = self.hal.event()
            wait_for.record()
        self.side_stream.wait_event(wait_for)
        with self.hal.use_stream(self.side_stream):
            first = draft.guess.index_select(0, self._tensor(rows))
            # eager: the verify graph may be replaying on the main stream, and graphs share one pool
            ahead = self._draft([draft.requests[b] for b in rows], first,
                                [draft.starts[b] + draft.num_drafts[b] + 1 for b in rows], nexts, blocks,
                                use_graphs=False)
            self.side_done = self.hal.event()
            self.side_done.record()
        return ahead, {b: i for i, b in enumerate(rows)}

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long).to(self.runner.device, non_blocking=True)


def verify_stages(model, first_loop: int, num_loops: int, states: torch.Tensor, ctx) -> torch.Tensor:
    """A uniform verify pass: loops `first_loop .. num_loops - 1` from the draft's `states: [1, N, X]`,
    then the head on every row -> logits `[N, V]` float32."""
    state = states
    for depth in range(first_loop, num_loops):
        state = model.loop(state, depth, ctx)
    return model.coda(state, ctx)[0].float()
