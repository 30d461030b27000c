"""`LLMEngine`: add_request / step / abort over the scheduler, block manager and model runner.

Each `step()` schedules up to `max_num_batched_tokens` new tokens across running and waiting
requests, runs them as one packed batch, samples, and returns the outputs of the requests that
advanced. It is single-threaded; a server drives it from one loop. With speculative decoding on,
decoding requests that draft run as one speculation round instead (runtime/speculation/speculator.py) and may
advance by several tokens.

With `async_scheduling` a step launches step t+1 before it reads step t's tokens: the scheduler
plans t+1 as if every request sampled at t got its token (a `PLACEHOLDER` the runner fills on the
device), and the host catches up one step later, so stop checks apply one step late: a request
that stopped at t has its t+1 work discarded. Outputs equal the synchronous engine's.
"""
from __future__ import annotations

import logging
import time
from typing import Iterable

import torch

from hal.base import Hal
from runtime.execution.async_step import PendingStep, StepResult
from runtime.config import EngineConfig, SamplingParams
from runtime.engine.kv_cache import BlockManager
from runtime.engine.outputs import RequestOutput
from runtime.engine.prefix_cache import PrefixPolicy
from runtime.execution.runner import ModelRunner
from runtime.execution.sampler import make_generator
from runtime.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from runtime.engine.sequence import PLACEHOLDER, Request, RequestStatus
from runtime.speculation.speculator import Speculator
from runtime.parallel.step_plan import PlanPublisher, check_supported
from runtime.engine.swap import SwapSpace
from runtime.text.tokenizer import Tokenizer
from zoo.base import LoopedCausalLM

log = logging.getLogger(__name__)


class LLMEngine:
    """`publisher` (tensor parallelism, rank 0: `ParallelState.publisher()`) sends every scheduled
    step to the other ranks, which run the same model runner on their shards; call `close()` when
    done so they free their KV cache."""

    def __init__(self, model: LoopedCausalLM, hal: Hal, config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None, extra_stop_token_ids: Iterable[int] = (),
                 publisher: PlanPublisher | None = None) -> None:
        self.model, self.hal, self.tokenizer = model, hal, tokenizer
        self.config = config or EngineConfig()
        self.max_model_len = min(self.config.max_model_len or model.max_seq_len, model.max_seq_len)
        self.max_loops = max(model.default_num_loops, 1)
        self.publisher = publisher
        if publisher is not None:          # followers build their runner now: its KV sizing is collective
            check_supported(self.config)
            publisher.open(self.config, self.max_model_len, self.max_loops)
        self.runner = ModelRunner(model, hal, self.config, self.max_model_len, self.max_loops)
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
        stops = list(model.stop_token_ids()) + list(extra_stop_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            stops.append(tokenizer.eos_token_id)
        self.default_stop_token_ids = frozenset(stops)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_computed_tokens = 0

    # ----- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, priority: int | None = None) -> Request:
        """Queue a request (`priority` overrides `params.priority`; lower = more urgent). Raises
        ValueError for bad input and MemoryError when the request could never fit in the KV cache;
        other requests are unaffected either way."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.publisher is not None:
            params = self.publisher.seeded(params)
        if not prompt_token_ids:
            raise ValueError("empty prompt: give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens does not fit the model's context "
                             f"of {self.max_model_len} tokens (one position must remain for the answer)")
        num_loops = params.num_loops or self.model.default_num_loops
        if num_loops > self.max_loops:
            self._grow_max_loops(num_loops)
        threshold = self.model.default_exit_threshold if params.exit_threshold is None else params.exit_threshold
        num_speculative = self._num_speculative_tokens(num_loops, threshold)
        request = Request(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params, num_loops=num_loops,
            exit_threshold=threshold,
            num_planes=self.runner.layout.num_planes(num_loops),
            stop_token_ids=frozenset() if params.ignore_eos else self.default_stop_token_ids,
            max_seq_len=self.max_model_len, prompt=prompt, generator=make_generator(params, self.runner.device),
            priority=params.priority if priority is None else int(priority),
            cache_salt=self._cache_salt(params), num_speculative_tokens=num_speculative)
        self.scheduler.add(request)          # MemoryError if it could never fit
        self.requests[request_id] = request
        return request

    def _num_speculative_tokens(self, num_loops: int, exit_threshold: float) -> int:
        """Draft tokens per round for a request: 0 when speculation is off or the request has no
        more loops than the draft (it then decodes normally)."""
        spec = self.config.speculative
        if not spec.is_enabled or num_loops <= spec.draft_loops:
            return 0
        if exit_threshold < 1.0:
            raise ValueError(f"speculative decoding does not support early exit (exit_threshold="
                             f"{exit_threshold}): set exit_threshold=1.0, or turn speculation off "
                             f"(speculative.num_tokens=0)")
        return spec.num_tokens

    def _cache_salt(self, params: SamplingParams) -> bytes | None:
        """Prefix caching: KV that depends on more than the tokens is never shared (Huginn's random
        initial state, unless init_scale=0)."""
        if not self.config.enable_prefix_caching:
            return None
        if self.model.has_initial_state and params.init_scale != 0:
            return None
        return b"loopstack"

    def _grow_max_loops(self, num_loops: int) -> None:
        # the pool is shared by all planes; more loops only change how many planes a request takes
        self.max_loops = num_loops

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (unknown or finished ids are ignored)."""
        request = self.requests.pop(request_id, None)
        if request is not None and not request.is_finished:
            self._finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    # ----- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of requests that produced a token or finished (async:
        of the previous batch, whose tokens the host reads while this one runs)."""
        plan = self.scheduler.schedule()
        if self.publisher is not None:           # tensor parallelism: the other ranks run this step too
            self.publisher.publish(plan, self.requests, self.blocks, self.scheduler.swapped)
        self._move_preempted(plan)
        launched = self._launch(plan) if not plan.is_empty else None
        if not self.config.async_scheduling:
            return self._apply(plan, launched) if launched is not None else []
        done, self._in_flight = self._in_flight, (plan, launched) if launched is not None else None
        return self._apply(done[0], done[1].result()) if done is not None else []

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
        result = self.runner.execute(plain, self.blocks, input_ids_from_device=fed,
                                     deferred=self.config.async_scheduling) if plain else StepResult({}, 0)
        if drafting:                            # speculation rounds (never with async scheduling)
            spec = self.speculator.run(drafting, self.blocks)
            for item in drafting:
                committed = spec.committed[item.request.request_id]
                item.request.num_computed_tokens += len(committed)      # t0 and the kept drafts
                result.sampled[item.request.request_id] = [(t, item.request.num_loops) for t in committed]
            self.num_computed_tokens += spec.num_tokens
        self.num_steps += 1
        self.num_computed_tokens += sum(item.num_new_tokens for item in plain)
        self.scheduler.advance(plain)
        if self.config.async_scheduling:
            for request in sampling:            # the device's token, known to the host one step later
                request.append_token(PLACEHOLDER, 0)
        return result

    def _apply(self, plan: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """The host learns a step's tokens: append them, check stops, finish, offer blocks to the cache."""
        outputs = []
        for request in {item.request.request_id: item.request for item in plan.scheduled}.values():
            if request.is_finished:
                continue                        # async: stopped a step earlier; this step's work is discarded
            sampled = result.sampled.get(request.request_id)
            status = None
            if isinstance(sampled, list):       # a speculation round: a stop token inside it ends it there
                for token in sampled:
                    request.append_token(*token)
                    status = request.check_stop()
                    if status is not None:
                        break
            elif sampled is not None:
                if self.config.async_scheduling:
                    status = request.check_stop(request.resolve_token(*sampled))
                else:
                    request.append_token(*sampled)
                    status = request.check_stop()
            self.scheduler.cache_blocks(request)
            if status is not None:
                self._finish(request, status)
            if sampled is not None:
                outputs.append(self.output_of(request))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.drop_unresolved()
        self.scheduler.finish(request, status)
        self.swap.drop(request.request_id)
        self.runner.forget(request.request_id)
        if status != RequestStatus.FINISHED_ABORTED:
            request.metrics.finished_time = time.monotonic()
        self.requests.pop(request.request_id, None)

    def output_of(self, request: Request) -> RequestOutput:
        n = request.num_resolved_outputs
        tokens = request.output_token_ids[:n]
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, tokens, text,
                             request.is_finished, request.status.value if request.is_finished else None,
                             request.loops_per_token[:n], metrics=request.metrics)

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
