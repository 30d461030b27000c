"""`LLMEngine`: add_request / step / abort over the scheduler, block manager and model runner.

Each `step()` schedules up to `max_num_batched_tokens` new tokens across running and waiting
requests, runs them as one packed batch, samples, and returns the outputs of the requests that
advanced. With speculative decoding on, decoding requests that draft run as one speculation round
instead (runtime/speculation.py) and may advance by several tokens. It is synchronous and
single-threaded; a server drives it from one loop.
"""
from __future__ import annotations

import logging
import time
from typing import Iterable

import torch

from hal.base import Hal
from runtime.config import EngineConfig, SamplingParams
from runtime.kv_cache import BlockManager, num_request_planes
from runtime.outputs import RequestOutput
from runtime.runner import ModelRunner, StepResult
from runtime.sampler import make_generator
from runtime.scheduler import Scheduler, SchedulerConfig
from runtime.sequence import Request, RequestStatus
from runtime.speculation import Speculator
from runtime.tokenizer import Tokenizer
from zoo.base import LoopedCausalLM

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: LoopedCausalLM, hal: Hal, config: EngineConfig | None = None,
                 tokenizer: Tokenizer | None = None, extra_stop_token_ids: Iterable[int] = ()) -> None:
        self.model, self.hal, self.tokenizer = model, hal, tokenizer
        self.config = config or EngineConfig()
        self.max_model_len = min(self.config.max_model_len or model.max_seq_len, model.max_seq_len)
        self.max_loops = max(model.default_num_loops, 1)
        self.runner = ModelRunner(model, hal, self.config, self.max_model_len, self.max_loops)
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_size)
        self.scheduler = Scheduler(SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                                   self.config.watermark_blocks), self.blocks)
        stops = list(model.stop_token_ids()) + list(extra_stop_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            stops.append(tokenizer.eos_token_id)
        self.default_stop_token_ids = frozenset(stops)
        spec = self.config.speculative
        self.speculator = Speculator(self.runner, spec) if spec.is_enabled else None
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_computed_tokens = 0

    # ----- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> Request:
        """Queue a request. Raises ValueError for bad input and MemoryError when the request could
        never fit in the KV cache; other requests are unaffected either way."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
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
            num_planes=num_request_planes(self.config.kv_mode, self.model.kv_spec.num_fixed_planes, num_loops),
            stop_token_ids=frozenset() if params.ignore_eos else self.default_stop_token_ids,
            max_seq_len=self.max_model_len, prompt=prompt, generator=make_generator(params, self.runner.device),
            num_speculative_tokens=num_speculative)
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

    def _grow_max_loops(self, num_loops: int) -> None:
        # the pool is shared by all planes; more loops only change how many planes a request takes
        self.max_loops = num_loops

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks (unknown or finished ids are ignored)."""
        request = self.requests.pop(request_id, None)
        if request is not None and not request.is_finished:
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ----- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of requests that produced a token or finished."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        now = time.monotonic()
        for item in plan.scheduled:
            if item.request.metrics.first_scheduled_time is None:
                item.request.metrics.first_scheduled_time = now
        drafting = [item for item in plan.scheduled if item.num_draft_tokens]
        plain = [item for item in plan.scheduled if not item.num_draft_tokens]
        result = self.runner.execute(plain, self.blocks) if plain else StepResult({}, 0)
        spec = self.speculator.run(drafting, self.blocks) if drafting else None
        self.num_steps += 1
        self.num_computed_tokens += result.num_tokens + (spec.num_tokens if spec else 0)
        outputs = []
        for item in plan.scheduled:
            request = item.request
            if item.num_draft_tokens:
                tokens = spec.committed[request.request_id]
                request.num_computed_tokens += len(tokens)      # t0 and the kept drafts
                loops = [request.num_loops] * len(tokens)
            elif request.request_id in result.sampled:
                request.num_computed_tokens += item.num_tokens
                token, loop = result.sampled[request.request_id]
                tokens, loops = [token], [loop]
            else:
                request.num_computed_tokens += item.num_tokens
                continue
            for token, loop in zip(tokens, loops):          # a stop token inside a draft ends it there
                request.append_token(token, loop)
                status = request.check_stop()
                if status is not None:
                    self.scheduler.finish(request, status)
                    request.metrics.finished_time = time.monotonic()
                    break
            outputs.append(self.output_of(request))
            if request.is_finished:
                self.requests.pop(request.request_id, None)
        return outputs

    def output_of(self, request: Request) -> RequestOutput:
        text = self.tokenizer.decode(request.output_token_ids) if self.tokenizer is not None else ""
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                             list(request.output_token_ids), text, request.is_finished,
                             request.status.value if request.is_finished else None,
                             list(request.loops_per_token), metrics=request.metrics)

    @torch.inference_mode()
    def run_until_done(self) -> list[RequestOutput]:
        """Step until every request has finished; the final output of each, in finishing order."""
        finished = []
        while self.has_unfinished_requests():
            finished.extend(o for o in self.step() if o.finished)
        return finished
