"""`LLM`: the user-facing facade, `LLM(model, hal="auto").generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
from typing import Any, Iterator, Mapping, Sequence

import torch

import hal as hal_registry
import zoo
from hal.base import Hal
from runtime.text.chat import RESERVED_TEMPLATE_KWARGS, Message, apply_chat_template
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.outputs import RequestOutput
from runtime.parallel.follower import Follower
from runtime.parallel.state import ParallelState
from runtime.parallel.step_plan import check_supported
from runtime.llm_options import (check_engine_keywords, check_seed, check_tensor_parallel_size,
                                 note_remote_code_unused, sampling_of_generation_config, seed_global_rngs,
                                 tokenizer_at)
from runtime.prompts import Prompt, check_sampling_params, params_list, prompt_list, token_ids
from runtime.text.tokenizer import Tokenizer
from zoo.base import LoopedCausalLM
from zoo.parallel import tensor_parallel
from zoo.sharding import shard

log = logging.getLogger(__name__)


class LLM:
    """A looped model on one Hal behind the batching engine, with its tokenizer when the checkpoint
    has one.

    `model` is a checkpoint folder, a known name ("ouro-1.4b", looked up in the local Hugging Face
    cache) or an already built zoo model. `dtype=None` or "auto" keeps the checkpoint's dtype.
    `tokenizer`: a `Tokenizer` or the folder of a tokenizer.json (default: the checkpoint's). Engine
    options (`kv_mode`, `max_num_seqs`, `max_num_batched_tokens`, `num_kv_blocks`, ...) are the fields
    of `runtime.config.EngineConfig`, given as keywords or as `engine_config=`. `stop_token_ids`: end
    tokens of the model besides its config's and tokenizer's eos (the model node's, e.g. Ouro's
    `<|im_end|>`); every request stops at them unless it sets `ignore_eos`.

    vLLM's constructor arguments: `seed` seeds Python's, NumPy's and torch's global RNGs once the
    engine is built, so requests without their own seed sample the same tokens run to run (a request's
    `SamplingParams.seed` still wins); `enforce_eager=True` is `graphs=False`; `trust_remote_code` is
    accepted and ignored (the models are loopstack's own, in zoo/: no checkpoint code runs);
    `tensor_parallel_size` must be 1, or the world size of `parallel` (see below).

    Tensor parallelism: `parallel` from `runtime.parallel.state.init_distributed` (under torchrun). The LLM
    lives on rank 0 and loads its shard; every other rank calls `follow(...)` with the same model
    and dtype. `close()` releases the other ranks' KV caches; `parallel.shutdown()` ends them.
    """

    def __init__(self, model: str | os.PathLike | LoopedCausalLM, hal: str | Hal = "auto",
                 dtype: torch.dtype | str | None = None,
                 tokenizer: Tokenizer | str | os.PathLike | None = None,
                 engine_config: EngineConfig | None = None, parallel: ParallelState | None = None,
                 stop_token_ids: Sequence[int] = (), seed: int | None = None,
                 trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 enforce_eager: bool = False, **engine_options) -> None:
        check_engine_keywords(engine_options)
        if engine_config is not None and engine_options:
            raise ValueError(f"give engine_config= or engine keywords ({', '.join(sorted(engine_options))}), "
                             f"not both")
        if engine_config is not None and not isinstance(engine_config, EngineConfig):
            raise TypeError(f"engine_config takes an EngineConfig, got {type(engine_config).__name__}: pass "
                            f"EngineConfig(...), or its fields as keywords (LLM(..., max_num_seqs=8))")
        config = engine_config or EngineConfig(**engine_options)
        if enforce_eager:
            if config.graphs:
                raise ValueError("enforce_eager=True and graphs=True contradict each other: enforce_eager "
                                 "is graphs=False; give one of them")
            config = dataclasses.replace(config, graphs=False)
        seed = check_seed(seed)
        if trust_remote_code:
            note_remote_code_unused()
        self.parallel = parallel or ParallelState()
        check_tensor_parallel_size(tensor_parallel_size, self.parallel)
        if not isinstance(hal, (str, Hal)):
            raise TypeError(f"hal takes a name ('auto', 'cpu', 'cuda', ...) or a Hal, got {hal!r}")
        self.hal = hal_registry.get(hal) if isinstance(hal, str) else hal
        if not self.parallel.is_driver:
            raise ValueError(f"LLM runs on rank 0 only; rank {self.parallel.rank} calls "
                             f"runtime.llm.follow(...)")
        if self.parallel.is_parallel:
            check_supported(config)                 # before loading a model for nothing
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = tokenizer_at(tokenizer)    # before the model: a wrong path fails at once
        elif tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            raise TypeError(f"tokenizer takes a folder with tokenizer.json or a runtime.text Tokenizer, got "
                            f"{type(tokenizer).__name__}")
        self.model, folder = load_model(model, self.hal, dtype, self.parallel)
        device = self.hal.device()
        if tokenizer is None and folder:
            tokenizer = Tokenizer.from_folder(folder)
        self.tokenizer = tokenizer
        self.engine = LLMEngine(self.model, self.hal, config, self.tokenizer, extra_stop_token_ids=stop_token_ids,
                                publisher=self.parallel.publisher(seed))
        self._generation_config = sampling_of_generation_config(folder)
        self._ids = itertools.count()
        # outputs of the requests a call is waiting for (a stream, a generate), by request id: one
        # call's engine steps also advance the others' requests, whose outputs wait here for them
        self._outputs: dict[str, collections.deque[RequestOutput]] = {}
        if seed is not None:
            # after construction: what building draws (a Hal's once-per-process probe, warm-up) then
            # cannot shift what the requests draw from the device's global RNG (sampler.py)
            seed_global_rngs(seed)
        log.info("LLM: %s on %s, dtype %s", type(self.model).__name__, device, next(self.model.parameters()).dtype)

    def get_tokenizer(self) -> Tokenizer | None:
        """The tokenizer (vLLM's accessor): the one given, else the checkpoint's; None without one."""
        return self.tokenizer

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
                return prompt.get("prompt"), token_ids(prompt["prompt_token_ids"])
            if keys != {"prompt"}:
                raise TypeError(f"a prompt dict takes 'prompt' (text) or 'prompt_token_ids', got keys {sorted(keys)}")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: pass token ids instead of text, or give "
                                 "LLM(tokenizer=<folder with tokenizer.json>)")
            return prompt, self.tokenizer.encode_prompt(prompt)
        return None, token_ids(prompt)

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
        prompts = prompt_list(prompts)
        params_of = params_list(sampling_params, len(prompts), self.get_default_sampling_params())
        order, results = [], {}
        try:
            for prompt, p in zip(prompts, params_of):
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
        waiting = [i for i in order if i not in results]
        for request_id in waiting:
            self._outputs[request_id] = collections.deque()
        try:
            while waiting:
                self._step()
                for request_id in waiting:
                    queue = self._outputs[request_id]
                    while queue:
                        out = queue.popleft()
                        if out.finished:
                            results[request_id] = out
                waiting = [i for i in waiting if i not in results]
        finally:                         # a failed step (or ^C): nothing of this call stays in the engine
            for request_id in order:
                self._outputs.pop(request_id, None)
                if request_id not in results:
                    self.engine.abort(request_id)
        return [results[i] for i in order]

    def _step(self) -> None:
        """One engine step; each output goes to the call waiting for its request (another caller's
        open stream included), none is lost."""
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("the engine finished without the output a call waits for")
        with torch.inference_mode():
            outputs = self.engine.step()
        for out in outputs:
            queue = self._outputs.get(out.request_id)
            if queue is None:
                continue
            if queue and not queue[-1].finished:   # outputs are cumulative: an unread one gives way to the next
                queue.pop()
            queue.append(out)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the growing output of one prompt after every token (the last one has `finished`). While
        the caller does not read, other calls' steps advance it too; it then resumes at the latest
        output (each holds every token so far)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        check_sampling_params(sampling_params)
        request_id = self._add(prompt, sampling_params)
        queue = self._outputs[request_id] = collections.deque()
        try:
            while True:
                if not queue:
                    self._step()
                    continue
                out = queue.popleft()
                yield out
                if out.finished:
                    return
        finally:                         # a caller that stops iterating (close, break) ends the request
            self._outputs.pop(request_id, None)
            self.engine.abort(request_id)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             enable_thinking: bool | None = None, use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template: str | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of `{"role", "content"}` dicts)
        or to each of several, through the checkpoint's chat template (or `chat_template`, Jinja
        source). `enable_thinking=True` opens the reply with `<think>` (thinking checkpoints); True or
        False reaches the template as a variable, None (the default) leaves it undefined, as
        transformers' apply_chat_template does. vLLM's `add_generation_prompt`,
        `continue_final_message` (the model continues the last message, e.g. an answer begun for it)
        and `chat_template_kwargs` (more template variables) as in `LLM.chat` there."""
        if self.tokenizer is None:
            raise ValueError("chat needs the checkpoint's tokenizer.json and chat template")
        extra = dict(chat_template_kwargs or {})
        if "enable_thinking" in extra:              # vLLM's documented place for Qwen3-style switches
            if enable_thinking is not None and enable_thinking != extra["enable_thinking"]:
                raise ValueError("enable_thinking is given twice, differently: as an argument and in "
                                 "chat_template_kwargs; give it once")
            enable_thinking = extra.pop("enable_thinking")
        taken = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}: LLM.chat sets them (its own "
                             f"arguments, the tokenizer's special tokens)")
        messages = list(messages)                   # an iterator of messages or of conversations too
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        texts = [apply_chat_template(self.tokenizer, conversation, add_generation_prompt, enable_thinking,
                                     chat_template, continue_final_message, **extra)
                 for conversation in conversations]
        # the template writes the BOS itself: encoded as a plain prompt it would get a second one
        prompts = [{"prompt": text, "prompt_token_ids": self.tokenizer.encode(text)} for text in texts]
        return self.generate(prompts, sampling_params)


def load_model(model: str | os.PathLike | LoopedCausalLM, hal: Hal, dtype: torch.dtype | str | None,
               parallel: ParallelState) -> tuple[LoopedCausalLM, str | os.PathLike | None]:
    """The model on the Hal's device (this rank's shard under tensor parallelism) and its folder."""
    device = hal.device()
    if isinstance(model, LoopedCausalLM):
        dtype = zoo.as_dtype(dtype)
        model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
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
