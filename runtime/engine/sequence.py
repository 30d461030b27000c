"""A request's life in the engine: its tokens, depth settings, state and metrics. Host bookkeeping,
no device code."""
from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from runtime.sampling_params import SamplingParams

# async scheduling: the id of a token the device has sampled but the host has not read yet
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"            # queued; holds no KV blocks
    RUNNING = "running"            # scheduled every step until it finishes
    FINISHED_STOPPED = "stop"      # produced a stop token
    FINISHED_LENGTH = "length"     # reached max_tokens or the model's context
    FINISHED_ABORTED = "abort"     # aborted by the caller (the server reports it as an error, not a finish reason)
    FINISHED_ERROR = "error"       # rejected (e.g. larger than the whole KV cache)

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


# finish codes a decode step computes on the device (runtime/execution/row_sampling.py), by index
CODE_STOPPED, CODE_LENGTH = 1, 2
STATUS_OF_CODE = (None, RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # speculative decoding: verification rounds, tokens drafted, drafted tokens the target accepted
    num_spec_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_cached_tokens: int = 0           # prompt tokens whose KV came from the prefix cache (last admission)

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def acceptance_rate(self) -> float | None:
        """Fraction of drafted tokens the target accepted (None before any speculation)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Drafted tokens accepted per verification round; each round also yields one token of the
        target's own, so a round produces `mean_accepted_length + 1` tokens on average."""
        return self.num_accepted_tokens / self.num_spec_rounds if self.num_spec_rounds else None


class WaveChunk(NamedTuple):
    """Wavefront prefill: prompt tokens [start, end) whose next loop is `depth` (loops < depth are done)."""

    start: int
    end: int
    depth: int


@dataclass
class Request:
    """One generation request. `num_computed_tokens` counts tokens whose KV is in the cache; the
    tokens still to compute are `all_token_ids[num_computed_tokens:]` (under wavefront prefill, tokens
    count as computed once they entered the loops; `wave_chunks` lists those still looping)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    num_loops: int                       # loops per token (resolved from params / the model)
    exit_threshold: float                # resolved; 1.0 = every token runs all loops
    num_planes: int                      # KV planes this request owns
    stop_token_ids: frozenset[int] = frozenset()
    max_seq_len: int = 1 << 30
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    loops_per_token: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    generator: Any = None                # torch.Generator for seeded sampling / initial states
    num_speculative_tokens: int = 0      # draft tokens per round (0: this request does not speculate)
    speculation: Any = None              # runtime.speculation.speculator's per-request state (seed, next round's draft)
    error: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    priority: int = 0                    # lower = more urgent (scheduling_policy=priority)
    arrival_seq: int = 0                 # arrival order, set by the scheduler
    cache_salt: bytes | None = None      # prefix caching: None = this request's KV is never shared
    block_hashes: list[bytes] = field(default_factory=list)     # chain digests of its full blocks so far
    wave_chunks: list[WaveChunk] = field(default_factory=list)  # wavefront prefill: chunks still looping
    # log-probabilities (runtime/execution/logprobs.py): of each resolved output token when asked
    logprobs: list[Any] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[Any] | None = None     # per prompt token (None for the first), when asked
    rank_by_logprob: bool = False        # best_of: the engine ranks samples by their logprobs
    sample_index: int = 0                # n > 1: which sample of its group this is
    group: Any = None                    # n > 1: the runtime.engine.sample_group.SampleGroup it belongs to
    detokenizer: Any = None              # runtime.text.detokenizer.IncrementalDetokenizer of its output
    stop_reason: int | str | None = None  # the stop token or string that finished it
    final_text: str | None = None        # its text when a stop string finished it (runtime/engine/stop_strings.py)

    @property
    def num_logprobs(self) -> int | None:
        """Top-k the sampler reports for each sampled token (0: only the token's own), or None."""
        if self.params.logprobs is not None:
            return self.params.logprobs
        return 0 if self.rank_by_logprob else None

    @functools.cached_property
    def prompt_array(self) -> np.ndarray:
        """The prompt as one int64 array, made once: a repetition penalty reads it every step
        (runtime/execution/sampler.py), and a 1K-token list costs tens of microseconds to convert."""
        return np.asarray(self.prompt_token_ids, dtype=np.int64)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens `[start, stop)` of prompt + output, without copying the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if stop <= num_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:stop - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - num_prompt]

    def token_at(self, position: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < num_prompt else self.output_token_ids[position - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Still computing tokens it did not generate itself (its prompt, or after a preemption)."""
        return self.num_uncomputed_tokens > 1 or bool(self.wave_chunks)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def max_draft_tokens(self) -> int:
        """Draft tokens a round may propose now: a round commits up to that many plus one, within
        max_tokens and the context (the last draft token's KV must fit below max_seq_len)."""
        if not self.num_speculative_tokens or self.is_prefill:
            return 0
        room = min(self.params.max_tokens - len(self.output_token_ids), self.max_seq_len - self.num_tokens)
        return max(0, min(self.num_speculative_tokens, room - 1))

    @property
    def num_settled_tokens(self) -> int:
        """Tokens whose KV is final in every plane (wavefront chunks still looping are not)."""
        return self.wave_chunks[0].start if self.wave_chunks else self.num_computed_tokens

    @property
    def num_resolved_outputs(self) -> int:
        """Output tokens the host knows (the rest are placeholders of steps still on the device)."""
        try:
            return self.output_token_ids.index(PLACEHOLDER)
        except ValueError:
            return len(self.output_token_ids)

    @property
    def is_length_capped(self) -> bool:
        """Its outputs (placeholders included) already reach max_tokens or the context: no more steps."""
        return len(self.output_token_ids) >= self.params.max_tokens or self.num_tokens >= self.max_seq_len

    def append_token(self, token_id: int, num_loops_run: int) -> None:
        if token_id != PLACEHOLDER and not self.num_resolved_outputs:
            self.metrics.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        self.loops_per_token.append(num_loops_run)

    def resolve_token(self, token_id: int, num_loops_run: int) -> int:
        """Async scheduling: fill the oldest placeholder with the token the device sampled; returns
        how many outputs are now known."""
        i = self.num_resolved_outputs
        assert i < len(self.output_token_ids), "no placeholder to resolve"
        if i == 0:
            self.metrics.first_token_time = time.monotonic()
        self.output_token_ids[i], self.loops_per_token[i] = token_id, num_loops_run
        return i + 1

    def drop_unresolved(self) -> None:
        """Forget the placeholders of steps whose results are discarded (the request finished)."""
        n = self.num_resolved_outputs
        del self.output_token_ids[n:], self.loops_per_token[n:]

    def check_stop(self, num_outputs: int | None = None) -> RequestStatus | None:
        """The finished status the output token `num_outputs - 1` (default: the last) implies, if any.
        Stop tokens count once more than min_tokens outputs exist (the sampler bans them before, so
        this only keeps the rule the same as the device's stop codes, runtime/execution/row_sampling.py)."""
        n = len(self.output_token_ids) if num_outputs is None else num_outputs
        last = self.output_token_ids[n - 1]
        if n > self.params.min_tokens and (last in self.stop_token_ids or last in self.params.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if n >= self.params.max_tokens or len(self.prompt_token_ids) + n >= self.max_seq_len:
            return RequestStatus.FINISHED_LENGTH
        return None
