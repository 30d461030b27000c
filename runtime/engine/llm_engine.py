"""`LLMEngine`: the step over the scheduler, block manager and model runner; add_request / abort
and the requests' outputs it inherits (runtime/engine/engine_requests.py).

Each `step()` schedules up to `max_num_batched_tokens` new tokens across running and waiting
requests, runs them as one packed batch, samples, and returns the outputs of the requests that
advanced. It is single-threaded; a server drives it from one loop. With speculative decoding on,
decoding requests that draft run as one speculation round instead (runtime/speculation/speculator.py) and may
advance by several tokens.

With `async_scheduling` a step launches step t+1 before it reads step t's tokens: the scheduler
plans t+1 as if every request sampled at t got its token (a `PLACEHOLDER` the runner fills on the
device), and the host catches up one step later, so stop checks apply one step late: a request
that stopped at t has its t+1 work discarded. Outputs equal the synchronous engine's. Decode steps
over the persistent batch check stops on the device and send a finish code with each token.
"""
from __future__ import annotations

import logging
import time
from typing import Iterable

import torch

from hal.base import Hal
from runtime.execution.async_step import PendingStep, StepResult
from runtime.config import EngineConfig, resolve_async
from runtime.engine.admission import fit_context, request_capacity
from runtime.engine.engine_requests import EngineRequests
from runtime.engine.kv_cache import BlockManager
from runtime.engine.outputs import RequestOutput
from runtime.engine.prefix_cache import PrefixPolicy
from runtime.execution.runner import ModelRunner
from runtime.engine.scheduler import Scheduler, SchedulerConfig
from runtime.engine.step_schedule import SchedulerOutput
from runtime.engine.sequence import PLACEHOLDER, STATUS_OF_CODE, RequestStatus
from runtime.engine.stop_strings import check_stop_strings
from runtime.speculation.speculator import Speculator
from runtime.parallel.step_plan import PlanPublisher, check_supported
from runtime.engine.swap import SwapSpace
from runtime.text.tokenizer import Tokenizer
from zoo.base import LoopedCausalLM

log = logging.getLogger(__name__)


class LLMEngine(EngineRequests):
    """The step over the requests it inherits (runtime/engine/engine_requests.py: add_request,
    abort, outputs). `publisher` (tensor parallelism, rank 0: `ParallelState.publisher()`) sends
    every scheduled step to the other ranks, which run the same model runner on their shards; call
    `close()` when done so they free their KV cache."""

    def __init__(self, model: LoopedCausalLM, hal: Hal, config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None, extra_stop_token_ids: Iterable[int] = (),
                 publisher: PlanPublisher | None = None) -> None:
        self.model, self.hal, self.tokenizer = model, hal, tokenizer
        # logprobs' `decoded_token` (vLLM's): the text one id adds (the tokenizer caches it)
        self._token_text = tokenizer.token_text if tokenizer is not None else None
        self.config = resolve_async(config or EngineConfig(), hal.device().type, publisher is not None)
        log.info("scheduling: %s", "one step ahead (async)" if self.config.async_scheduling else "synchronous")
        for note in hal.speed_notes(self.config.kv_dtype not in ("auto", None), self.config.weights_dtype == "fp8"):
            log.warning("%s", note)
        # the context: the model's positions (or engine.max_model_len); a request ends there ("length")
        if self.config.max_model_len is not None and self.config.max_model_len > model.max_seq_len:
            raise ValueError(f"engine.max_model_len={self.config.max_model_len} is longer than the model's "
                             f"{model.max_seq_len} positions (its max_position_embeddings): set "
                             f"engine.max_model_len={model.max_seq_len} or less, or leave it out")
        self.context_len = min(self.config.max_model_len or model.max_seq_len, model.max_seq_len)
        self.max_model_len = self.context_len    # the longest request at the model's depth the cache holds
        # a block belongs to one request: one past the context (and the Hal's own sizes) stays mostly empty
        sizes = hal.caps.kv_block_sizes
        if self.config.block_size is not None and self.config.block_size > max(self.context_len, *sizes):
            raise ValueError(f"engine.block_size={self.config.block_size} is more tokens than a request can hold "
                             f"(max_model_len {self.context_len}), so most of each block would stay empty; use "
                             f"{sizes[0]} (the Hal's own: leave it unset)")
        self.default_num_loops = self.config.default_num_loops or model.default_num_loops
        self.max_loops = max(self.default_num_loops, 1)
        self.publisher = publisher
        if publisher is not None:          # followers build their runner now: its KV sizing is collective
            check_supported(self.config)
            publisher.open(self.config, self.max_model_len, self.max_loops)
        self.runner = ModelRunner(model, hal, self.config, self.max_model_len, self.max_loops)
        self._fit_context_to_cache()
        cfg = self.config
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_size, cfg.enable_prefix_caching)
        max_swap_blocks = 0
        if cfg.preemption_mode == "swap":
            max_swap_blocks = min(cfg.swap_space_bytes // self.runner.bytes_per_block, self.runner.num_blocks)
        sched = SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.watermark_blocks,
                                cfg.scheduling_policy, cfg.preemption_mode, max_swap_blocks,
                                cfg.wavefront_prefill)
        prefix = PrefixPolicy(self.runner.block_size, self.runner.layout)
        self.scheduler = Scheduler(sched, self.blocks, prefix)
        self.swap = SwapSpace(hal, self.runner.backend, self.runner.kv_caches)
        self._in_flight: tuple[SchedulerOutput, PendingStep] | None = None     # async: the launched step
        spec = cfg.speculative
        self.speculator = Speculator(self.runner, spec) if spec.is_enabled else None
        if spec.is_enabled and self.default_num_loops <= spec.draft_loops:
            log.warning("engine.speculative.draft_loops=%d is not below the default %d loops: requests at that "
                        "depth do not speculate (only those that ask for more loops); lower draft_loops",
                        spec.draft_loops, self.default_num_loops)
        extra_stop_token_ids = list(extra_stop_token_ids)
        stops = list(model.stop_token_ids()) + extra_stop_token_ids
        bad = [t for t in stops if not (isinstance(t, int) and 0 <= t < 2 ** 63)]
        if bad:                  # the persistent batch stores them as int64 (runtime/execution/row_params.py)
            raise ValueError(f"stop token ids must be integers in [0, 2^63), got {bad[:3]} (model.stop_token_ids "
                             f"or the config's eos_token_id)")
        # the user's (a request's own are refused the same way, admission.check_request); a family's
        # fixed end ids may lie past a tiny test model's vocabulary
        unreachable = [t for t in extra_stop_token_ids if isinstance(t, int) and t >= model.config.vocab_size]
        if unreachable:
            raise ValueError(f"stop token ids {unreachable[:3]} are outside the model's vocabulary of "
                             f"{model.config.vocab_size}, so they could never end an answer: fix model.stop_token_ids "
                             f"(or the checkpoint's eos_token_id)")
        # the tokenizer's end token: the one stop token that finishes with stop_reason None (vLLM's EOS)
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else None
        if self.eos_token_id is not None:
            stops.append(self.eos_token_id)
        self.default_stop_token_ids = frozenset(stops)
        self.requests = {}
        self.groups = {}
        self.num_steps = 0
        self.num_computed_tokens = 0
        # benchmarks: a runtime.execution.step_timer.StepTimer records device events around each step
        self.timer = None

    def _fit_context_to_cache(self) -> None:
        """`max_model_len` capped to the longest request the KV cache can ever hold (admission.fit_context)."""
        self.max_model_len = fit_context(self.max_model_len, self.config.max_model_len, self.runner.num_blocks,
                                         self.runner.block_size, self.runner.layout.num_planes(self.max_loops),
                                         self.max_loops)

    def max_request_len(self, num_loops: int) -> int:
        """The most tokens (prompt + max_tokens) a request of `num_loops` loops is admitted with:
        `max_model_len`, or less where its depth's KV planes outgrow the cache."""
        num_planes = self.runner.layout.num_planes(num_loops)
        return min(self.max_model_len, request_capacity(self.runner.num_blocks, self.runner.block_size, num_planes))

    @property
    def is_tensor_parallel(self) -> bool:
        """Whether other ranks replay this engine's steps (a failed step may leave them out of step)."""
        return self.publisher is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    # ----- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of requests that produced a token or finished (async:
        of the previous batch, whose tokens the host reads while this one runs)."""
        plan = self.scheduler.schedule()
        if plan.is_empty and self._in_flight is None and self.scheduler.waiting and not self.scheduler.running:
            return self._fail_unschedulable()
        if self.publisher is not None:           # tensor parallelism: the other ranks run this step too
            self.publisher.publish(plan, self.requests, self.blocks, self.scheduler.swapped)
        self._move_preempted(plan)
        launched = self._launch(plan) if not plan.is_empty else None
        if not self.config.async_scheduling:
            return self._apply(plan, launched) if launched is not None else []
        done, self._in_flight = self._in_flight, (plan, launched) if launched is not None else None
        return self._apply(done[0], done[1].result()) if done is not None else []

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing runs and the first waiting request still cannot start: it never will (admission
        should have refused it). Fail it rather than spin."""
        request = self.scheduler.waiting[0]
        request.error = (f"request {request.request_id} cannot be scheduled even with the engine idle "
                         f"({self.blocks.num_free_blocks} of {self.blocks.num_blocks} KV blocks free)")
        log.error("%s", request.error)
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return [self.output_of(request)]

    def _move_preempted(self, plan: SchedulerOutput) -> None:
        """Swap copies (issued before the step that reuses the blocks, in stream order)."""
        for request in plan.preempted:
            if request.request_id not in self.scheduler.swapped:
                self.runner.forget(request.request_id)
        for copy in plan.swap_out:
            self.swap.swap_out(copy.request_id, copy.blocks)
        for copy in plan.swap_in:
            self.swap.swap_in(copy.request_id, copy.blocks)

    def _launch(self, plan: SchedulerOutput) -> StepResult | PendingStep:
        """The step's device work; its tokens count as computed from here on."""
        now = time.monotonic()
        for item in plan.scheduled:
            if item.request.metrics.first_scheduled_time is None:
                item.request.metrics.first_scheduled_time = now
        drafting = [item for item in plan.scheduled if item.num_draft_tokens]
        plain = [item for item in plan.scheduled if not item.num_draft_tokens]
        sampling = [item.request for item in plain if item.samples]
        fed = self._in_flight[1] if self._in_flight is not None else None
        if self.timer is not None:
            self.timer.start(len(plan.scheduled) if all(i.num_tokens == 1 for i in plan.scheduled) else None)
        result = self.runner.execute(plain, self.blocks, input_ids_from_device=fed,
                                     deferred=self.config.async_scheduling) if plain else StepResult({}, 0)
        if drafting:                            # speculation rounds (never with async scheduling)
            spec = self.speculator.run(drafting, self.blocks)
            for item in drafting:
                committed = spec.committed[item.request.request_id]
                item.request.num_computed_tokens += len(committed)      # t0 and the kept drafts
                result.sampled[item.request.request_id] = [(t, item.request.num_loops) for t in committed]
            self.num_computed_tokens += spec.num_tokens
        if self.timer is not None:
            self.timer.stop()
        self.num_steps += 1
        self.num_computed_tokens += sum(item.num_new_tokens for item in plain)
        self.scheduler.advance(plain)
        if self.config.async_scheduling:
            for request in sampling:            # the device's token, known to the host one step later
                request.append_token(PLACEHOLDER, 0)
        return result

    def _apply(self, plan: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """The host learns a step's tokens: append them, check stops, finish, offer blocks to the cache."""
        outputs, groups = [], {}
        for request in {item.request.request_id: item.request for item in plan.scheduled}.values():
            if request.is_finished:
                continue                        # async: stopped a step earlier; this step's work is discarded
            rid = request.request_id
            if result.prompt_logprobs and rid in result.prompt_logprobs:
                first, values = result.prompt_logprobs[rid]
                for entry in values:
                    if entry is not None:
                        entry.decode = self._token_text
                if request.prompt_logprobs is None:
                    request.prompt_logprobs = [None] * len(request.prompt_token_ids)
                request.prompt_logprobs[first:first + len(values)] = values
            sampled = result.sampled.get(rid)
            if sampled is not None and result.logprobs and rid in result.logprobs:
                result.logprobs[rid].decode = self._token_text
                request.logprobs.append(result.logprobs[rid])
                request.cumulative_logprob += result.logprobs[rid].logprob
            status = None
            if isinstance(sampled, list):       # a speculation round: a stop inside it ends it there
                for token in sampled:
                    request.append_token(*token)
                    status = self._check_stop_strings(request, request.check_stop())
                    if status is not None:
                        break
            elif sampled is not None:
                num_outputs = None
                if self.config.async_scheduling:
                    num_outputs = request.resolve_token(*sampled)
                else:
                    request.append_token(*sampled)
                # a decode step over the persistent batch decided on the device (the same rule)
                code = result.codes.get(rid) if result.codes else None
                status = request.check_stop(num_outputs) if code is None else STATUS_OF_CODE[code]
                status = self._check_stop_strings(request, status)
            if status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None:
                # vLLM's rule: a stop token names itself (the request's own, and the model's other end
                # tokens, which vLLM takes from generation_config), except the tokenizer's EOS, which
                # leaves None, also where the request lists it, unless it ignores EOS
                last = request.output_token_ids[request.num_resolved_outputs - 1]
                eos = last == self.eos_token_id and not request.params.ignore_eos
                request.stop_reason = None if eos else last
            if request.group is not None and request.sample_index == 0 and request.num_resolved_outputs \
                    and len(request.group.samples) < request.group.best_of:
                self._fork(request)             # before a stop could free the prompt blocks
            self.scheduler.cache_blocks(request)
            if status is not None:
                self._finish(request, status)
            if sampled is None:
                continue
            if request.group is None:
                outputs.append(self.output_of(request))
            else:                               # once per step, after all its samples of the step
                groups.setdefault(request.group.request_id, request)
        for request in groups.values():
            if request.group.best_of == request.group.n or request.group.finished:
                outputs.append(self.output_of(request))
        return outputs

    def _check_stop_strings(self, request, status: RequestStatus | None) -> RequestStatus | None:
        """`status` (what the request's newest token implies), or FINISHED_STOPPED where its text now
        holds one of its stop strings: a stop string also counts on the token that reaches the length."""
        if not request.params.stop or status == RequestStatus.FINISHED_STOPPED:
            return status
        match = check_stop_strings(request, self.tokenizer)
        if match is None:
            return status
        request.stop_reason, request.final_text = match
        return RequestStatus.FINISHED_STOPPED

    def close(self) -> None:
        """Release the other tensor-parallel ranks' runners (a no-op on one rank)."""
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None

    @torch.inference_mode()
    def run_until_done(self) -> list[RequestOutput]:
        """Step until every request has finished; the final output of each, in finishing order."""
        finished = []
        while self.has_unfinished_requests():
            finished.extend(o for o in self.step() if o.finished)
        return finished

