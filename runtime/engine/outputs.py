"""What generation returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple


class TokenLogprobs(NamedTuple):
    """Log-probabilities at one position: the token that stands there (sampled or given in the
    prompt), its logprob under the model, its rank (1 = the most likely token), and the `k` most
    likely tokens with theirs (`logprobs=k` / `prompt_logprobs=k`), most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class CompletionOutput:
    """One of a request's `n` samples."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"; None while running
    loops_per_token: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None    # per generated token, with `logprobs=k`
    cumulative_logprob: float | None = None        # sum over its tokens, where logprobs were computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state. `token_ids`, `text`, `finish_reason`, `loops_per_token` and `logprobs`
    are those of its first sample; `outputs` lists every sample (one unless `n > 1`)."""

    request_id: str
    prompt: str | None                   # the prompt text when one was given
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None     # "stop" (a stop token) | "length" (max_tokens / context) | "abort"
    loops_per_token: list[int] = field(default_factory=list)   # loops each generated token ran
    metrics: Any = None                  # runtime.engine.sequence.RequestMetrics (times, preemptions)
    error: str | None = None             # why the request was rejected (finish_reason "error")
    logprobs: list[TokenLogprobs] | None = None
    # prompt_logprobs=k: one entry per prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = [CompletionOutput(0, list(self.token_ids), self.text,
                                             self.finish_reason if self.finished else None,
                                             list(self.loops_per_token), self.logprobs)]
