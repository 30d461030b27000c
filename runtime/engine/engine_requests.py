"""The engine's requests by id, from admission to their output: `add_request` (the checks of
runtime/engine/admission.py, then the request's loops, exit threshold, speculation and stop tokens
resolved and the request queued), the samples of an n > 1 request (runtime/engine/sample_group.py;
queued once sample 0 computed its prompt), `abort`, a request's finish (its KV, host copies and
runner state freed) and the output it reports. `LLMEngine` (runtime/engine/llm_engine.py) inherits
this and adds the step.
"""
from __future__ import annotations

import dataclasses
import time

from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.engine.admission import cache_salt, check_request, num_speculative_tokens, sample_of
from runtime.engine.outputs import RequestOutput, request_output
from runtime.engine.sample_group import SampleGroup
from runtime.engine.scheduler import Scheduler
from runtime.engine.sequence import Request, RequestStatus
from runtime.engine.swap import SwapSpace
from runtime.execution.runner import ModelRunner
from runtime.execution.sampler import make_generator
from runtime.parallel.step_plan import PlanPublisher
from runtime.text.tokenizer import Tokenizer
from zoo.base import LoopedCausalLM


class EngineRequests:
    """The request side of `LLMEngine`, which inherits it and sets what it reads below."""

    model: LoopedCausalLM
    config: EngineConfig
    tokenizer: Tokenizer | None
    publisher: PlanPublisher | None
    runner: ModelRunner
    scheduler: Scheduler
    swap: SwapSpace
    context_len: int                 # a request ends here ("length")
    default_num_loops: int           # a request's depth where it names none (config, else the model's)
    max_loops: int                   # that depth, or the deepest request since
    default_stop_token_ids: frozenset[int]
    requests: dict[str, Request]
    groups: dict[str, SampleGroup]   # n > 1: request id -> its samples

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, priority: int | None = None) -> Request:
        """Queue a request (`priority` overrides `params.priority`; lower = more urgent). Raises
        ValueError for bad input and MemoryError when the request could never fit in the KV cache;
        other requests are unaffected either way."""
        if request_id in self.requests or request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        owner = self.groups.get(request_id.rpartition("#")[0])
        if owner is not None and owner.owns(request_id):    # its samples fork under "<id>#<i>" later
            raise ValueError(f"request id {request_id!r} is kept for a sample of request {owner.request_id!r} "
                             f"(n/best_of > 1): choose another id")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need the model's tokenizer, and this engine has none: give it one "
                             "(LLM(tokenizer=<folder>), LLMEngine(..., tokenizer=...)) or stop on token ids "
                             "(stop_token_ids)")
        if self.publisher is not None:
            params = self.publisher.seeded(params)
        num_loops = params.num_loops or self.default_num_loops
        if params.max_tokens is None:          # vLLM's None: what the context (and the cache) leaves
            params = self._up_to_the_context(prompt_token_ids, params, num_loops)
        check_request(prompt_token_ids, params, num_loops, self.model.config.vocab_size, self.context_len,
                      self.config)
        if num_loops > self.max_loops:
            self._grow_max_loops(num_loops)
        threshold = self.model.default_exit_threshold if params.exit_threshold is None else params.exit_threshold
        num_speculative = num_speculative_tokens(self.config.speculative, num_loops, threshold, params)
        group = None
        if params.num_samples > 1:
            group = SampleGroup(request_id, params.n, params.num_samples)
            taken = [group.child_id(i) for i in range(1, group.best_of) if group.child_id(i) in self.requests]
            if taken:
                raise ValueError(f"request id {taken[0]!r} (a sample of {request_id!r}) is already in use")
            params = dataclasses.replace(params, n=1, best_of=None)
        request = Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params, num_loops=num_loops,
            exit_threshold=threshold,
            num_planes=self.runner.layout.num_planes(num_loops),
            stop_token_ids=frozenset() if params.ignore_eos else self.default_stop_token_ids,
            max_seq_len=self.context_len, prompt=prompt, generator=make_generator(params, self.runner.device),
            priority=params.priority if priority is None else int(priority),
            cache_salt=cache_salt(self.config.enable_prefix_caching, self.model.has_initial_state, params),
            num_speculative_tokens=num_speculative)
        if params.prompt_logprobs is not None:   # one entry per prompt token, None for the first (as vLLM)
            request.prompt_logprobs = [None] * len(request.prompt_token_ids)
        self.scheduler.add(request)          # MemoryError if it could never fit
        self.requests[request_id] = request
        if group is not None:
            request.group, request.rank_by_logprob = group, group.best_of > group.n
            group.samples.append(request)
            self.groups[request_id] = group
        return request

    def _up_to_the_context(self, prompt_token_ids: list[int], params: SamplingParams,
                           num_loops: int) -> SamplingParams:
        """`params` with max_tokens=None made the room its prompt leaves: the context, or less where
        the KV cache holds less of a request at its depth; errors that name no max_tokens, which the
        caller did not give."""
        longest = self.max_request_len(num_loops)
        room = longest - len(prompt_token_ids)
        if room < 1 and len(prompt_token_ids) < self.context_len:    # a longer prompt: check_request's error
            raise MemoryError(f"a prompt of {len(prompt_token_ids)} tokens leaves no room to generate: at "
                              f"{num_loops} loops the KV cache holds at most {longest} tokens of one request; "
                              f"shorten the prompt, use fewer loops or kv_mode=shared, or give the KV cache more "
                              f"memory (engine.num_kv_blocks, engine.gpu_memory_utilization)")
        if params.min_tokens > max(room, 1):
            raise ValueError(f"min_tokens={params.min_tokens} is more than the {room} tokens the context leaves "
                             f"this prompt of {len(prompt_token_ids)} (max_tokens=None): lower min_tokens")
        return dataclasses.replace(params, max_tokens=max(room, 1))

    def _fork(self, parent: Request) -> None:
        """n > 1: sample 0 computed its prompt; queue the other samples, sharing its prompt blocks."""
        group = parent.group
        # KV that depends on more than the tokens (Huginn's random initial state) is never shared,
        # as in the prefix cache (admission.cache_salt): each sample then computes its own prompt
        share = cache_salt(True, self.model.has_initial_state, parent.params) is not None
        for index in range(len(group.samples), group.best_of):
            child = sample_of(parent, index, group.child_id(index),
                              lambda params: make_generator(params, self.runner.device))
            self.scheduler.fork(parent, child, share=share)
            self.requests[child.request_id] = child
            group.samples.append(child)

    def _grow_max_loops(self, num_loops: int) -> None:
        # the pool is shared by all planes; more loops only change how many planes a request takes
        self.max_loops = num_loops

    def abort(self, request_id: str) -> None:
        """Stop a request (every sample of it) and free its KV blocks (unknown or finished ids are
        ignored)."""
        group = self.groups.pop(request_id, None)
        for request in group.samples if group is not None else [self.requests.get(request_id)]:
            if request is not None and not request.is_finished:
                self._finish(request, RequestStatus.FINISHED_ABORTED)
            if request is not None:
                self.requests.pop(request.request_id, None)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.drop_unresolved()
        self.scheduler.finish(request, status)
        self.swap.drop(request.request_id)
        self.runner.forget(request.request_id)
        if status != RequestStatus.FINISHED_ABORTED:
            request.metrics.finished_time = time.monotonic()
        self.requests.pop(request.request_id, None)
        if request.group is not None and request.group.finished:
            self.groups.pop(request.group.request_id, None)

    def output_of(self, request: Request, ending: bool = False) -> RequestOutput:
        """The request's output; for a sample of an n > 1 request, the whole request's (every
        sample so far; with best_of > n, the n best once all have finished). `ending`: it is the
        last (an abort): nothing of the text is held back for a stop string, and with best_of > n
        it shows the n best samples so far."""
        group = request.group
        if group is None:
            return request_output([request], request.request_id, request.is_finished, self.tokenizer, ending=ending)
        return request_output(group.reported(ending), group.request_id, group.finished, self.tokenizer, group.samples[0],
                              ending=ending)

    def output_for(self, request_id: str, finish_reason: str | None = None) -> RequestOutput | None:
        """The latest output of a request by its id (None when the engine does not know it); with
        `finish_reason`, marked finished with that reason (an abort)."""
        group = self.groups.get(request_id)
        request = group.samples[0] if group is not None else self.requests.get(request_id)
        if request is None:
            return None
        out = self.output_of(request, ending=finish_reason is not None)
        if finish_reason is not None:
            for sample in out.outputs:
                sample.finish_reason = sample.finish_reason or finish_reason
            out.finished, out.finish_reason = True, out.outputs[0].finish_reason
        return out
