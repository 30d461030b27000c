"""What a request must satisfy to enter the engine, and the derived settings it enters with: the
checks `LLMEngine.add_request` runs before anything is queued (bad input is a ValueError naming the
fix, and leaves every other request untouched), the longest request the KV cache can ever hold,
speculation and prefix-cache eligibility, and the extra samples of an n > 1 request. Pure Python.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from runtime.config import EngineConfig, SpeculativeConfig
from runtime.sampling_params import SamplingParams
from runtime.engine.sequence import Request, RequestMetrics, RequestStatus
from runtime.execution.keyed_random import derive_seed

log = logging.getLogger(__name__)

MORE_MEMORY = ("give the KV cache more memory (engine.num_kv_blocks, engine.kv_cache_memory_bytes or "
               "engine.gpu_memory_utilization), lower engine.max_num_seqs, or use engine.kv_mode=shared")


def request_capacity(num_blocks: int, block_size: int, num_planes: int) -> int:
    """The most tokens (prompt + output) one request of `num_planes` KV planes can ever have with the
    whole cache to itself: its planes' KV positions, and the last token, which is never computed."""
    return num_blocks // num_planes * block_size + 1


class ContextDoesNotFit(ValueError):
    """engine.max_model_len asks for more than the KV cache holds for one request; `where` says why
    (the cache's blocks and the request's planes), for a caller that chose the length itself."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def fit_context(max_model_len: int, setting: int | None, num_blocks: int, block_size: int, num_planes: int,
                num_loops: int) -> int:
    """The longest request (at the model's depth, `num_planes` KV planes) the cache can ever hold,
    capped at `max_model_len` with a log line; ValueError where the setting (`engine.max_model_len`)
    asked for more or nothing fits, naming what to change."""
    fit = request_capacity(num_blocks, block_size, num_planes)
    if fit >= max_model_len:
        return max_model_len
    where = (f"the KV cache has {num_blocks} blocks of {block_size} tokens and a request with {num_loops} loops "
             f"uses {num_planes} KV planes, so one request holds at most {fit} tokens")
    if fit < 2:
        raise ValueError(f"{where}: nothing can run; {MORE_MEMORY}")
    if setting is not None:
        raise ContextDoesNotFit(f"engine.max_model_len={setting} does not fit: {where}; set "
                                f"engine.max_model_len={fit} or less, or {MORE_MEMORY}", where)
    log.warning("max_model_len capped from %d to %d tokens: %s; longer requests are refused at "
                "admission", max_model_len, fit, where)
    return fit


def check_request(prompt_token_ids: list[int], params: SamplingParams, num_loops: int, vocab_size: int,
                  context_len: int, config: EngineConfig) -> None:
    """ValueError for a request the engine must refuse, naming the fix."""
    if params.prompt_logprobs is not None and config.wavefront_prefill:
        raise ValueError("prompt_logprobs needs every prompt chunk to run all loops in one step: set "
                         "engine.wavefront_prefill=false")
    if not prompt_token_ids:
        raise ValueError("empty prompt: give at least one token")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(prompt_token_ids) >= context_len:
        raise ValueError(f"prompt of {len(prompt_token_ids)} tokens does not fit the model's context "
                         f"of {context_len} tokens (one position must remain for the answer)")
    if num_loops > config.max_num_loops:
        raise ValueError(f"num_loops={num_loops} is above the limit of {config.max_num_loops} loops "
                         f"(engine.max_num_loops): ask for fewer loops or raise engine.max_num_loops")
    bad_bias = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad_bias:
        raise ValueError(f"logit_bias names token ids outside the vocabulary of {vocab_size}: {bad_bias[:5]}")
    bad_stops = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad_stops:                # the model can never sample them: such a stop would silently never fire
        raise ValueError(f"stop_token_ids names token ids outside the vocabulary of {vocab_size}: {bad_stops[:5]}")


def num_speculative_tokens(spec: SpeculativeConfig, num_loops: int, exit_threshold: float,
                           params: SamplingParams) -> int:
    """Draft tokens per round for a request: 0 when speculation is off, the request has no more
    loops than the draft, or it needs what a speculation round does not compute (logprobs,
    penalties, logit bias, min_tokens, best_of): it then decodes normally."""
    if not spec.is_enabled or num_loops <= spec.draft_loops:
        return 0
    if params.changes_logits or params.logprobs is not None or params.best_of not in (None, params.n):
        return 0
    if exit_threshold < 1.0:
        raise ValueError(f"speculative decoding does not support early exit (exit_threshold="
                         f"{exit_threshold}): set the request's exit_threshold to 1.0 (model.exit_threshold=1.0 "
                         f"on the command line), or turn speculation off (engine.speculative.num_tokens=0)")
    return spec.num_tokens


def cache_salt(enable_prefix_caching: bool, has_initial_state: bool, params: SamplingParams) -> bytes | None:
    """Prefix caching: KV that depends on more than the tokens is never shared (Huginn's random
    initial state, unless init_scale=0)."""
    if not enable_prefix_caching or (has_initial_state and params.init_scale != 0):
        return None
    return b"loopstack"


def sample_of(parent: Request, index: int, child_id: str, make_generator: Any) -> Request:
    """Sample `index` of an n > 1 request: the parent's prompt and settings (a seed derived per
    sample), no output yet; `make_generator(params)` gives its random generator."""
    params = parent.params
    if params.seed is not None:
        params = dataclasses.replace(params, seed=derive_seed(params.seed, index))
    return dataclasses.replace(
        parent, request_id=child_id, params=params, output_token_ids=[], loops_per_token=[],
        num_computed_tokens=0, status=RequestStatus.WAITING, generator=make_generator(params), speculation=None,
        error=None, metrics=RequestMetrics(arrival_time=parent.metrics.arrival_time), block_hashes=[],
        wave_chunks=[], logprobs=[], cumulative_logprob=0.0, prompt_logprobs=None, sample_index=index,
        detokenizer=None, stop_reason=None, final_text=None)
