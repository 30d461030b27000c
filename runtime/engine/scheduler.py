"""Continuous batching under a per-step token budget. Pure Python.

Every step the scheduler says how many new tokens each request computes ({request: num_tokens}):
1 for a decoding request, a chunk of its prompt for a prefilling one. Decoding requests are served
first, so a long prompt is chunked around them and never stalls them; new requests join while
others decode. Features (docs/scheduling.md):
- preemption: when the cache cannot grow a running request, a victim (the newest; under the
  priority policy the least urgent) gives its blocks back: `recompute` drops its KV (it prefills
  again later), `swap` has the engine copy its blocks to host memory and back on readmission;
- priority policy: the waiting queue is ordered by (priority, arrival), and a waiting request may
  preempt running requests of strictly lower priority to get a slot or blocks;
- prefix caching: an admitted request starts from the cached blocks of its longest cached prefix;
- wavefront prefill: a prompt that does not fit the step's budget enters the loops chunk by chunk,
  each chunk running one loop per step (`ScheduledRequest.is_wave`), see runtime/execution/eager_pass.py.

The queues themselves, and what changes them between steps (arrival, n > 1 forks, finishing, prefix
cache registration), are `RequestQueues` (runtime/engine/request_queues.py), which `Scheduler` inherits.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

from runtime.engine.prefix_cache import NO_HIT, PrefixHit
from runtime.engine.request_queues import RequestQueues
from runtime.engine.sequence import Request, RequestStatus, WaveChunk
from runtime.engine.step_schedule import BlockCopy, ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256              # requests running at once
    max_num_batched_tokens: int = 2048   # new tokens per step, prefill chunks included
    watermark_blocks: int = 0            # free blocks kept back when admitting, to limit preemption
    policy: str = "fcfs"                 # fcfs | priority
    preemption_mode: str = "recompute"   # recompute | swap
    max_swap_blocks: int = 0             # host blocks for swapped-out KV; beyond them, recompute
    wavefront: bool = False              # wavefront prefill for prompts longer than the step's budget

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


class Scheduler(RequestQueues):
    """One step's decisions over the queues it inherits: which requests compute how many tokens."""

    # ----- the step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._budget = self.config.max_num_batched_tokens
        self._scheduled: list[ScheduledRequest] = []
        self._out = SchedulerOutput(self._scheduled, [], [], [])     # lists the helpers append to
        done: set[str] = set()

        # running requests: decodes first, then continuing prefill chunks (by priority first)
        order = (lambda r: (r.priority, r.is_prefill, r.arrival_seq)) if self.config.policy == "priority" \
            else (lambda r: r.is_prefill)
        running = sorted(self.running, key=order)
        reserves = self._draft_reserves(running)
        for i, request in enumerate(running):
            if request.status != RequestStatus.RUNNING:
                continue                     # preempted earlier in this step
            if request.is_length_capped:     # async: it ends once its last token is read; never a victim
                done.add(request.request_id)
                continue
            num_tokens = min(request.num_uncomputed_tokens, self._budget)
            if request.wave_chunks or (num_tokens and self._wants_wave(request, num_tokens)):
                self._schedule_wave(request, num_tokens, done)
            elif num_tokens:
                num_drafts = self._num_drafts(request, self._budget - num_tokens, reserves[i])
                if self._grow(request, request.num_computed_tokens + num_tokens, done):
                    if num_drafts:                  # room for the drafts' KV; fewer drafts rather than a preemption
                        num_drafts = self._num_drafts(request, self._budget - num_tokens, reserves[i])
                        self.blocks.allocate(request.request_id, request.num_planes,
                                             request.num_computed_tokens + num_tokens + num_drafts)
                    self._add(ScheduledRequest(request, num_tokens, num_draft_tokens=num_drafts))
            if any(item.request is request for item in self._scheduled[-1:]):
                done.add(request.request_id)

        # waiting requests join while budget, slots and blocks allow (in queue order: no overtaking);
        # not after a preemption for memory, nor a request preempted in this very step
        under_pressure = bool(self._out.preempted)
        while self.waiting and self._budget > 0 and not under_pressure:
            request = self.waiting[0]
            if any(r is request for r in self._out.preempted):
                break
            hit = self._prefix_hit(request)
            base = request.num_computed_tokens or hit.num_blocks * self.blocks.block_size
            total = base + min(request.num_tokens - base, self._budget)
            while not self._admissible(request, total, hit):
                victim = self._victim(request, set(), lower_only=True)
                if victim is None:
                    if not self.running and self._release_waiting(keep=request):
                        continue                 # blocks held by queued samples stood in the way
                    break
                self._preempt(victim)
                hit = self._prefix_hit(request)
            if not self._admissible(request, total, hit):
                break
            self._admit(request, base, total, hit)
        return self._out

    def _admissible(self, request: Request, total: int, hit: PrefixHit) -> bool:
        # the watermark keeps room for running requests to grow; with none running it would only
        # keep a request that fits out forever
        reserve = self.config.watermark_blocks if self.running else 0
        return len(self.running) < self.config.max_num_seqs and self.blocks.can_allocate(
            request.request_id, request.num_planes, total, reserve=reserve, hit=hit)

    def _admit(self, request: Request, base: int, total: int, hit: PrefixHit) -> None:
        self.waiting.pop(0)
        if request.num_computed_tokens == 0:
            request.num_computed_tokens = base
            request.metrics.num_cached_tokens = base
        self.blocks.allocate(request.request_id, request.num_planes, total, hit)
        per_plane = self.swapped.pop(request.request_id, 0)
        if per_plane:
            self.num_swapped_blocks -= per_plane * request.num_planes
            tables = self.blocks.block_tables(request.request_id)
            blocks = [t[j] for t in tables for j in range(per_plane)]
            self._out.swap_in.append(BlockCopy(request.request_id, blocks))
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        num_tokens = total - request.num_computed_tokens
        self._add(ScheduledRequest(request, num_tokens, request.num_computed_tokens, 0, True)
                  if self._wants_wave(request, num_tokens) else ScheduledRequest(request, num_tokens))

    def _add(self, item: ScheduledRequest) -> None:
        self._scheduled.append(item)
        self._budget -= item.num_new_tokens + item.num_draft_tokens

    def _num_drafts(self, request: Request, budget: int, reserve: int) -> int:
        """Draft tokens for a decoding request: as many as its settings, the budget and the free
        blocks less `reserve` allow (fewer drafts rather than a preemption; 0 = a plain decode)."""
        num_drafts = min(request.max_draft_tokens, max(budget, 0))
        total = request.num_computed_tokens + 1
        while num_drafts and not self.blocks.can_allocate(request.request_id, request.num_planes,
                                                          total + num_drafts, reserve=reserve):
            num_drafts -= 1
        return num_drafts

    def _draft_reserves(self, running: list[Request]) -> list[int]:
        """Per running request (in scheduling order), the blocks the requests after it need for this
        step's plain tokens: drafts come out of what is left, so one request's drafts never get a
        later one preempted. Zeros (no work) when no request drafts."""
        if not any(r.max_draft_tokens for r in running):
            return [0] * len(running)
        needs = [0 if r.status != RequestStatus.RUNNING or r.is_length_capped
                 else self.blocks.num_blocks_needed(r.request_id, r.num_planes,
                                                    r.num_computed_tokens + min(r.num_uncomputed_tokens, self._budget))
                 for r in running]
        reserves, after = [0] * len(running), 0
        for i in range(len(running) - 1, -1, -1):
            reserves[i] = after
            after += needs[i]
        return reserves

    def _prefix_hit(self, request: Request) -> PrefixHit:
        if self.prefix is None or request.cache_salt is None or request.num_computed_tokens:
            return NO_HIT
        if request.params.prompt_logprobs is not None:      # every prompt row's logits are needed
            return NO_HIT
        return self.blocks.match_prefix(self.prefix.block_keys(request, self.prefix.max_hit_blocks(request)))

    # ----- wavefront prefill ----------------------------------------------------------------
    def _wants_wave(self, request: Request, num_tokens: int) -> bool:
        """A prompt too long for this step's budget enters as a wavefront (runtime/execution/eager_pass.py);
        requests with early exit keep the standard path (their exit decisions span all loops)."""
        return (self.config.wavefront and request.num_loops > 1 and request.exit_threshold >= 1.0
                and num_tokens < request.num_uncomputed_tokens)

    def _schedule_wave(self, request: Request, num_tokens: int, done: set[str]) -> None:
        """Every in-flight chunk runs its next loop; a new chunk enters when blocks allow (with no
        chunk in flight, the usual preemption applies; with some, the request just waits for blocks)."""
        for chunk in request.wave_chunks:
            self._add(ScheduledRequest(request, chunk.end - chunk.start, chunk.start, chunk.depth, True))
        if not num_tokens:
            return
        total = request.num_computed_tokens + num_tokens
        if request.wave_chunks:
            if not self.blocks.can_allocate(request.request_id, request.num_planes, total):
                return
            self.blocks.allocate(request.request_id, request.num_planes, total)
        elif not self._grow(request, total, done):
            return
        self._add(ScheduledRequest(request, num_tokens, request.num_computed_tokens, 0, True))

    # ----- memory pressure ------------------------------------------------------------------
    def _grow(self, request: Request, total: int, done: set[str]) -> bool:
        """Allocate blocks for `total` tokens, preempting victims as needed; without any, the
        request itself is preempted (returns False)."""
        rid, planes = request.request_id, request.num_planes
        while not self.blocks.can_allocate(rid, planes, total):
            victim = self._victim(request, done)
            if victim is None:
                if self._release_waiting():
                    continue
                self._preempt(request)
                return False
            self._preempt(victim)
        self.blocks.allocate(rid, planes, total)
        return True

    def _victim(self, request: Request, protected: set[str], lower_only: bool = False) -> Request | None:
        """The running request to preempt for `request`: FCFS the newest (never one already
        scheduled this step); priority the least urgent, only if less urgent than `request`."""
        candidates = [r for r in self.running if r is not request and r.request_id not in protected]
        if self.config.policy != "priority":
            return None if lower_only or not candidates else candidates[-1]
        worst = max(candidates, key=self._key, default=None)
        if worst is None or self._key(worst) < self._key(request):
            return None
        return worst if not lower_only or worst.priority > request.priority else None

    def _preempt(self, request: Request) -> None:
        """Give the request's blocks back: swap its computed KV to host when the mode and the swap
        space allow (wavefront chunks in flight cannot be swapped), else recompute it later."""
        rid = request.request_id
        per_plane = self.blocks.blocks_per_plane(request.num_computed_tokens)
        if (self.config.preemption_mode == "swap" and per_plane and not request.wave_chunks
                and self.num_swapped_blocks + per_plane * request.num_planes <= self.config.max_swap_blocks):
            tables = self.blocks.block_tables(rid)
            self._out.swap_out.append(BlockCopy(rid, [t[j] for t in tables for j in range(per_plane)]))
            self.swapped[rid] = per_plane
            self.num_swapped_blocks += per_plane * request.num_planes
        else:
            request.num_computed_tokens = 0
            request.wave_chunks = []
        self.blocks.free(rid)
        self.running.remove(request)
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        bisect.insort(self.waiting, request, key=self._key)
        self._out.preempted.append(request)
        # a victim already scheduled this step (priority admission) gives its place back
        for item in [s for s in self._scheduled if s.request is request]:
            self._scheduled.remove(item)
            self._budget += item.num_new_tokens + item.num_draft_tokens

    # ----- after a step ---------------------------------------------------------------------
    def advance(self, scheduled: list[ScheduledRequest]) -> None:
        """The step's tokens are computed (or on their way: stream order keeps them ahead of any
        later reader). Wavefront chunks move one loop deeper."""
        for item in scheduled:
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            if item.is_wave:
                start = item.first_token
                chunks = [c for c in request.wave_chunks if c.start != start]
                if item.depth + 1 < request.num_loops:
                    chunks.append(WaveChunk(start, start + item.num_tokens, item.depth + 1))
                request.wave_chunks = sorted(chunks)
