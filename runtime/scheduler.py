"""Continuous batching under a per-step token budget. Pure Python.

Every step the scheduler says how many new tokens each request computes ({request: num_tokens}):
1 for a decoding request, a chunk of its prompt for a prefilling one; a speculating decode
computes 1 token and verifies `num_draft_tokens` more, so it is budgeted (and given KV room for)
1 + that many. Decoding requests are served
first, so a long prompt is chunked around them and never stalls them; new requests join while
others decode. When the cache cannot grow a running request, the most recently admitted one is
preempted: its blocks are freed and it is recomputed later from its tokens (same output).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from runtime.kv_cache import BlockManager
from runtime.sequence import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256              # requests running at once
    max_num_batched_tokens: int = 2048   # new tokens per step, prefill chunks included
    watermark_blocks: int = 0            # free blocks kept back when admitting, to limit preemption

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


class ScheduledRequest(NamedTuple):
    request: Request
    num_tokens: int          # new tokens computed this step, starting at request.num_computed_tokens
    num_draft_tokens: int = 0   # speculation: tokens drafted after them and verified in the same step

    @property
    def samples(self) -> bool:
        """Whether this step produces the request's next token (its last uncomputed token is in it)."""
        return self.num_tokens == self.request.num_uncomputed_tokens


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        if not self.blocks.fits_at_all(request.num_planes, request.num_tokens + 1):
            raise MemoryError(
                f"request {request.request_id} needs {request.num_planes} KV planes x "
                f"{self.blocks.blocks_per_plane(request.num_tokens + 1)} blocks, more than the whole cache "
                f"({self.blocks.num_blocks} blocks); shorten the prompt, use fewer loops or kv_mode=shared, "
                f"or give the KV cache more memory")
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        done: set[str] = set()

        # running requests: decodes first, then continuing prefill chunks
        for request in sorted(self.running, key=lambda r: r.is_prefill):
            if budget == 0:
                break
            if request.request_id in {r.request_id for r in preempted}:
                continue
            num_tokens = min(request.num_uncomputed_tokens, budget)
            num_drafts = self._num_drafts(request, budget - num_tokens)
            total = request.num_computed_tokens + num_tokens
            while not self.blocks.can_allocate(request.request_id, request.num_planes, total):
                victim = self._preemption_victim(done | {request.request_id}, preempted)
                if victim is None:
                    break
                self._preempt(victim)
                preempted.append(victim)
            if not self.blocks.can_allocate(request.request_id, request.num_planes, total):
                self._preempt(request)
                preempted.append(request)
                continue
            self.blocks.allocate(request.request_id, request.num_planes, total + num_drafts)
            scheduled.append(ScheduledRequest(request, num_tokens, num_drafts))
            done.add(request.request_id)
            budget -= num_tokens + num_drafts

        # waiting requests join while budget, slots and blocks allow (FIFO: no overtaking)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            request = self.waiting[0]
            num_tokens = min(request.num_uncomputed_tokens, budget)
            total = request.num_computed_tokens + num_tokens
            if not self.blocks.can_allocate(request.request_id, request.num_planes, total,
                                            reserve=self.config.watermark_blocks):
                break
            self.waiting.popleft()
            self.blocks.allocate(request.request_id, request.num_planes, total)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_tokens))
            budget -= num_tokens
        return SchedulerOutput(scheduled, preempted)

    def _num_drafts(self, request: Request, budget: int) -> int:
        """Draft tokens for a decoding request: as many as its settings, the budget and the free
        blocks allow (fewer drafts rather than a preemption; 0 = a plain decode)."""
        num_drafts = min(request.max_draft_tokens, budget)
        total = request.num_computed_tokens + 1
        while num_drafts and not self.blocks.can_allocate(request.request_id, request.num_planes,
                                                          total + num_drafts):
            num_drafts -= 1
        return num_drafts

    def _preemption_victim(self, protected: set[str], preempted: list[Request]) -> Request | None:
        gone = {r.request_id for r in preempted}
        for request in reversed(self.running):
            if request.request_id not in protected and request.request_id not in gone:
                return request
        return None

    def _preempt(self, request: Request) -> None:
        """Recompute policy: drop the KV; the request re-prefills all its tokens when readmitted."""
        self.blocks.free(request.request_id)
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        self.waiting.appendleft(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free its blocks (running or waiting)."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)
