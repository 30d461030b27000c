"""A request with `n > 1` or `best_of > 1`: its samples, run as engine requests of their own."""
from __future__ import annotations

from dataclasses import dataclass, field

from runtime.engine.sequence import Request, RequestStatus


@dataclass
class SampleGroup:
    """The samples of one request with `n > 1` or `best_of > 1`. Sample 0 runs first under the
    caller's request id; the others are forked from it once its prompt is computed (they share the
    prompt's KV blocks) under ids `"<id>#<i>"`. With `best_of > n` the n samples of highest mean
    logprob per token are returned, once all have finished."""

    request_id: str
    n: int
    best_of: int
    samples: list[Request] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.best_of and all(r.is_finished for r in self.samples)

    def child_id(self, index: int) -> str:
        return f"{self.request_id}#{index}"

    def reported(self, ending: bool = False) -> list[Request]:
        """The samples an output shows: all so far; with best_of > n, once all have finished or when
        the output is the last (`ending`: an abort, with samples still running or never forked), the
        n of highest mean logprob per token (a sample that ended early by an abort or an error only
        after every complete one: its few tokens' mean says nothing of a whole answer)."""
        if self.best_of > self.n and (self.finished or ending):
            return sorted(self.samples, key=lambda r: (not r.is_finished or r.status in _CUT_SHORT,
                                                       -mean_logprob(r)))[:self.n]
        return list(self.samples)

    def owns(self, request_id: str) -> bool:
        """Whether `request_id` is one of this group's sample ids, forked or still to be."""
        index = request_id.rpartition("#")[2]
        return index.isdigit() and 0 < int(index) < self.best_of and request_id == self.child_id(int(index))


_CUT_SHORT = (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


def mean_logprob(request: Request) -> float:
    return request.cumulative_logprob / max(len(request.logprobs), 1)
