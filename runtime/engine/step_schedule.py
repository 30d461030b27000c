"""One step's schedule, as the scheduler hands it to the engine: how many tokens each request
computes (wavefront segments and speculative drafts included), which requests were preempted, and
which KV blocks move to or from host memory before the step. A module of its own because the runner,
the speculator and the tensor-parallel step plan read a schedule without needing the scheduler that
made it. Pure Python.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from runtime.engine.sequence import Request


class ScheduledRequest(NamedTuple):
    request: Request
    num_tokens: int          # tokens (packed rows) of this item
    start: int | None = None # wavefront segment: its first token; else request.num_computed_tokens
    depth: int = 0           # wavefront segment: the one loop it runs (standard items run all loops)
    is_wave: bool = False
    num_draft_tokens: int = 0   # speculation: tokens drafted after them and verified in the same step

    @property
    def first_token(self) -> int:
        return self.request.num_computed_tokens if self.start is None else self.start

    @property
    def num_new_tokens(self) -> int:
        """Tokens this item adds to the request's computed tokens (wave chunks count when they enter)."""
        return self.num_tokens if self.depth == 0 else 0

    @property
    def samples(self) -> bool:
        """Whether this step produces the request's next token (its last uncomputed token is in it)."""
        req = self.request
        if self.is_wave:
            return self.depth == req.num_loops - 1 and self.first_token + self.num_tokens == req.num_tokens
        return self.num_tokens == req.num_uncomputed_tokens


class BlockCopy(NamedTuple):
    request_id: str
    blocks: list[int]        # device blocks, plane-major, holding the request's computed tokens


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledRequest]
    preempted: list[Request]
    swap_out: Sequence[BlockCopy] = ()     # copy these blocks to host before the step (then they are reused)
    swap_in: Sequence[BlockCopy] = ()      # copy the request's host blocks into these before the step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
