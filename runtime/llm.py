"""`LLM`: the user-facing facade, `LLM(model, hal="auto").generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
import json
import logging
import operator
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence, Union

import torch

import hal as hal_registry
import zoo
from hal.base import Hal
from runtime.text.chat import Message, apply_chat_template
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.outputs import RequestOutput
from runtime.parallel.follower import Follower
from runtime.parallel.state import ParallelState
from runtime.parallel.step_plan import check_supported
from runtime.text.tokenizer import Tokenizer
from zoo.base import LoopedCausalLM
from zoo.parallel import tensor_parallel
from zoo.sharding import shard

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]


class LLM:
    """A looped model on one Hal behind the batching engine, with its tokenizer when the checkpoint
    has one.

    `model` is a checkpoint folder, a known name ("ouro-1.4b", looked up in the local Hugging Face
    cache) or an already built zoo model. `dtype=None` keeps the checkpoint's dtype. Engine options
    (`kv_mode`, `max_num_seqs`, `max_num_batched_tokens`, `num_kv_blocks`, ...) are the fields of
    `runtime.config.EngineConfig`, given as keywords or as `engine_config=`. `stop_token_ids`: end
    tokens of the model besides its config's and tokenizer's eos (the model node's, e.g. Ouro's
    `<|im_end|>`); every request stops at them unless it sets `ignore_eos`.

    Tensor parallelism: `parallel` from `runtime.parallel.state.init_distributed` (under torchrun). The LLM
    lives on rank 0 and loads its shard; every other rank calls `follow(...)` with the same model
    and dtype. `close()` releases the other ranks' KV caches; `parallel.shutdown()` ends them.
    """

    def __init__(self, model: str | os.PathLike | LoopedCausalLM, hal: str | Hal = "auto",
                 dtype: torch.dtype | str | None = None, tokenizer: Tokenizer | None = None,
                 engine_config: EngineConfig | None = None, parallel: ParallelState | None = None,
                 stop_token_ids: Sequence[int] = (), **engine_options) -> None:
        self.hal = hal_registry.get(hal) if isinstance(hal, str) else hal
        self.parallel = parallel or ParallelState()
        if not self.parallel.is_driver:
            raise ValueError(f"LLM runs on rank 0 only; rank {self.parallel.rank} calls "
                             f"runtime.llm.follow(...)")
        if engine_config is not None and engine_options:
            raise ValueError("give engine_config= or engine keywords, not both")
        config = engine_config or EngineConfig(**engine_options)
        if self.parallel.is_parallel:
            check_supported(config)                 # before loading a model for nothing
        self.model, folder = load_model(model, self.hal, dtype, self.parallel)
        device = self.hal.device()
        self.tokenizer = tokenizer or (Tokenizer.from_folder(folder) if folder else None)
        self.engine = LLMEngine(self.model, self.hal, config, self.tokenizer, extra_stop_token_ids=stop_token_ids,
                                publisher=self.parallel.publisher())
        self._generation_config = _sampling_of_generation_config(folder)
        self._ids = itertools.count()
        log.info("LLM: %s on %s, dtype %s", type(self.model).__name__, device, next(self.model.parameters()).dtype)

    def close(self) -> None:
        """Free the other tensor-parallel ranks' runners (a no-op on one rank)."""
        self.engine.close()

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a prompt: a string, token ids, or vLLM's dict forms
        `{"prompt": text}` and `{"prompt_token_ids": ids}`. Text gets the tokenizer's special tokens
        (`Tokenizer.encode_prompt`: a BOS where its post-processor adds one), as in vLLM."""
        if isinstance(prompt, Mapping):
            keys = set(prompt)
            if "prompt_token_ids" in keys and keys <= {"prompt_token_ids", "prompt"}:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            if keys != {"prompt"}:
                raise TypeError(f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids', got keys {sorted(keys)}")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: pass token ids (prompt_ids) instead of text")
            return prompt, self.tokenizer.encode_prompt(prompt)
        return None, _token_ids(prompt)

    def _add(self, prompt: Prompt, params: SamplingParams) -> str:
        text, ids = self.encode(prompt)
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, ids, params, prompt=text)
        return request_id

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without `sampling_params` (vLLM's rule): the checkpoint's
        generation_config.json temperature / top_p / top_k / repetition_penalty over SamplingParams'
        defaults (temperature 1.0)."""
        return SamplingParams(**self._generation_config)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or vLLM's `{"prompt": ...}` /
        `{"prompt_token_ids": ...}` dicts), all batched together; outputs in prompt order. A prompt
        the engine rejects (e.g. larger than the whole KV cache) gets an output with
        `finish_reason="error"` and `.error`; the others run normally. Invalid input raises.
        `use_tqdm` is accepted for vLLM's callers; no progress bar is drawn."""
        prompts = _as_prompt_list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        order, results = [], {}
        try:
            for prompt, p in zip(prompts, params_list):
                try:
                    order.append(self._add(prompt, p))
                except MemoryError as exc:
                    request_id = str(next(self._ids))
                    order.append(request_id)
                    text, ids = self.encode(prompt)
                    results[request_id] = RequestOutput(request_id, text, ids, finished=True,
                                                        finish_reason="error", error=str(exc))
                    log.warning("request rejected: %s", exc)
        except BaseException:            # invalid input: the prompts added before it leave the engine too
            for request_id in order:
                self.engine.abort(request_id)
            raise
        for out in self.engine.run_until_done():
            results[out.request_id] = out
        return [results[i] for i in order]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the growing output of one prompt after every token (the last one has `finished`)."""
        request_id = self._add(prompt, sampling_params or self.get_default_sampling_params())
        try:
            with torch.inference_mode():
                while True:
                    for out in self.engine.step():
                        if out.request_id == request_id:
                            yield out
                            if out.finished:
                                return
        finally:                         # a caller that stops iterating (close, break) ends the request
            self.engine.abort(request_id)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             enable_thinking: bool | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of `{"role", "content"}` dicts)
        or to each of several, through the checkpoint's chat template. `enable_thinking=True` opens the
        reply with `<think>` (thinking checkpoints); True or False reaches the template as a variable,
        None (the default) leaves it undefined, as transformers' apply_chat_template does."""
        if self.tokenizer is None:
            raise ValueError("chat needs the checkpoint's tokenizer.json and chat template")
        messages = list(messages)                   # an iterator of messages or of conversations too
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        texts = [apply_chat_template(self.tokenizer, conversation, enable_thinking=enable_thinking)
                 for conversation in conversations]
        # the template writes the BOS itself: encoded as a plain prompt it would get a second one
        prompts = [{"prompt": text, "prompt_token_ids": self.tokenizer.encode(text)} for text in texts]
        return self.generate(prompts, sampling_params)


def load_model(model: str | os.PathLike | LoopedCausalLM, hal: Hal, dtype: torch.dtype | str | None,
               parallel: ParallelState) -> tuple[LoopedCausalLM, str | os.PathLike | None]:
    """The model on the Hal's device (this rank's shard under tensor parallelism) and its folder."""
    device = hal.device()
    if isinstance(model, LoopedCausalLM):
        model = model.to(device=device, dtype=zoo.as_dtype(dtype)) if dtype else model.to(device)
        if parallel.is_parallel and tensor_parallel(model) is None:
            shard(model, parallel.rank, parallel.world_size, parallel.comm)
        return model, getattr(model, "name_or_path", None)
    folder = zoo.resolve_checkpoint(model)
    return zoo.from_pretrained(folder, dtype=dtype, device=device, **parallel.shard_args()), folder


def follow(model: str | os.PathLike | LoopedCausalLM, hal: str | Hal, dtype: torch.dtype | str | None,
           parallel: ParallelState) -> None:
    """What ranks other than 0 of a tensor-parallel run do instead of building an `LLM`: load this
    rank's shard of the same model and execute rank 0's steps until it shuts down."""
    hal = hal_registry.get(hal) if isinstance(hal, str) else hal
    loaded, _ = load_model(model, hal, dtype, parallel)
    with torch.inference_mode():
        Follower(loaded, hal, parallel.channel).run()


def _token_ids(prompt: Any) -> list[int]:
    try:
        return [operator.index(t) for t in prompt]
    except TypeError:
        raise TypeError(f"a prompt is a string, a list of token ids or a dict with 'prompt' or "
                        f"'prompt_token_ids', got {type(prompt).__name__}: {str(prompt)[:80]}") from None


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]                                # one prompt of token ids
    return prompts


def _sampling_of_generation_config(folder: str | os.PathLike | None) -> dict[str, Any]:
    """The sampling fields of a checkpoint's generation_config.json that SamplingParams takes."""
    path = Path(folder) / "generation_config.json" if folder else None
    if path is None or not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return {}
    return {k: raw[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty") if raw.get(k) is not None}
