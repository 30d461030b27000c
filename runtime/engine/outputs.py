"""What generation returns."""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from runtime.engine.sequence import RequestStatus
from runtime.engine.stop_strings import detokenizer_of, holdback_len


class Logprob(NamedTuple):
    """One token's entry at a position, as vLLM's `Logprob`: `decoded_token` is the token's own text
    (the tokenizer's decoding of that one id, special tokens kept) where the engine has a tokenizer."""

    logprob: float
    rank: int                              # 1 = the most likely token
    decoded_token: str | None = None


class TokenLogprobs(Mapping[int, Logprob]):
    """Log-probabilities at one position: the token that stands there (sampled or given in the
    prompt), its logprob under the model, its rank (1 = the most likely token), and the `k` most
    likely tokens with theirs (`logprobs=k` / `prompt_logprobs=k`), most likely first.

    It is also the mapping vLLM gives per position, token id -> `Logprob`: the token that stands
    there first, then the top k (`lp[token_id].logprob`, `lp.items()`), so code written for vLLM's
    outputs reads ours."""

    __slots__ = ("token_id", "logprob", "rank", "top", "decode", "_entries")

    def __init__(self, token_id: int, logprob: float, rank: int, top: tuple[tuple[int, float], ...] = ()) -> None:
        self.token_id, self.logprob, self.rank, self.top = token_id, logprob, rank, tuple(top)
        self.decode: Callable[[int], str] | None = None     # token id -> text, set by the engine
        self._entries: dict[int, Logprob] | None = None

    def _mapping(self) -> dict[int, Logprob]:
        if self._entries is None:            # built on first use: the server reads the fields only
            text = self.decode or (lambda token: None)
            entries = {self.token_id: Logprob(self.logprob, self.rank, text(self.token_id))}
            for rank, (token, logprob) in enumerate(self.top, start=1):
                if token not in entries:
                    entries[token] = Logprob(logprob, rank, text(token))
            self._entries = entries
        return self._entries

    def __getitem__(self, token_id: int) -> Logprob:
        return self._mapping()[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._mapping())

    def __len__(self) -> int:
        return len(self._mapping())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenLogprobs):
            return self.as_list() == other.as_list()
        return super().__eq__(other)

    __hash__ = None                          # a mapping: unhashable, as dict

    def __repr__(self) -> str:
        return f"TokenLogprobs(token_id={self.token_id}, logprob={self.logprob}, rank={self.rank}, top={self.top})"

    def as_list(self) -> list[Any]:
        """`[token_id, logprob, rank, [[token_id, logprob], ...]]` (the CLI's JSON form)."""
        return [self.token_id, self.logprob, self.rank, [list(pair) for pair in self.top]]


@dataclass
class CompletionOutput:
    """One of a request's `n` samples."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: int | str | None = None  # with "stop": the stop_token_ids entry or stop string; None at EOS
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
                                             self.finish_reason if self.finished else None, None,
                                             list(self.loops_per_token), self.logprobs)]


def _text(request: Any, tokens: list[int], tokenizer: Any, ending: bool = False) -> str:
    """The text of a sample's resolved tokens: decoded a window at a time while it runs (each step
    reports it, less what could start a stop string unless `ending`: its last report, an abort),
    once in full when it has finished; a stop token's or string's text left out
    (runtime/engine/stop_strings.py)."""
    if tokenizer is None:
        return ""
    if request.final_text is not None:
        return request.final_text
    detokenizer = detokenizer_of(request, tokenizer)
    if not request.is_finished:
        text, held = detokenizer.update(tokens), 0 if ending else holdback_len(request.params)
        return text[:max(len(text) - held, 0)]
    if request.status == RequestStatus.FINISHED_STOPPED and not request.params.include_stop_str_in_output:
        tokens = tokens[:-1]                # it ended on a stop token
    return detokenizer.finish(tokens)


def request_output(samples: Sequence[Any], request_id: str, finished: bool, tokenizer: Any = None,
                   first: Any = None, ending: bool = False) -> RequestOutput:
    """The output of a request from its samples (`runtime.engine.sequence.Request`s; `first`, the
    one that holds the prompt and metrics, defaults to the first): tokens resolved so far, their
    text through `tokenizer` when there is one, loops and logprobs."""
    first = first or samples[0]
    completions = []
    for index, request in enumerate(samples):
        n = request.num_resolved_outputs
        tokens = request.output_token_ids[:n]
        text = _text(request, tokens, tokenizer, ending)
        wants = request.params.logprobs is not None
        completions.append(CompletionOutput(
            index, tokens, text, request.status.value if request.is_finished else None, request.stop_reason,
            request.loops_per_token[:n], request.logprobs[:n] if wants else None,
            request.cumulative_logprob if request.num_logprobs is not None else None))
    head = completions[0]
    return RequestOutput(request_id, first.prompt, first.prompt_token_ids, head.token_ids, head.text, finished,
                         head.finish_reason if finished else None, head.loops_per_token,
                         metrics=first.metrics, error=first.error, logprobs=head.logprobs,
                         prompt_logprobs=first.prompt_logprobs, outputs=completions)
