"""`LLM`: the user-facing facade, `LLM(model, hal="auto").generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import json
import logging
import operator
import os
import random
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
        _check_engine_keywords(engine_options)
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
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0):
            raise ValueError(f"seed must be an integer >= 0 (or None), got {seed!r}")
        if trust_remote_code:
            _note_remote_code_unused()
        self.parallel = parallel or ParallelState()
        _check_tensor_parallel_size(tensor_parallel_size, self.parallel)
        if not isinstance(hal, (str, Hal)):
            raise TypeError(f"hal takes a name ('auto', 'cpu', 'cuda', ...) or a Hal, got {hal!r}")
        self.hal = hal_registry.get(hal) if isinstance(hal, str) else hal
        if not self.parallel.is_driver:
            raise ValueError(f"LLM runs on rank 0 only; rank {self.parallel.rank} calls "
                             f"runtime.llm.follow(...)")
        if self.parallel.is_parallel:
            check_supported(config)                 # before loading a model for nothing
        if isinstance(tokenizer, (str, os.PathLike)):
            tokenizer = _tokenizer_at(tokenizer)    # before the model: a wrong path fails at once
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
        self._generation_config = _sampling_of_generation_config(folder)
        self._ids = itertools.count()
        if seed is not None:
            # after construction: what building draws (a Hal's once-per-process probe, warm-up) then
            # cannot shift what the requests draw from the device's global RNG (sampler.py)
            _seed_global_rngs(seed)
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
        for p in params_list:
            _check_sampling_params(p)
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
        try:
            for out in self.engine.run_until_done():
                results[out.request_id] = out
        except BaseException:            # a failed step (or ^C): nothing of this call stays in the engine
            for request_id in order:
                if request_id not in results:
                    self.engine.abort(request_id)
            raise
        return [results[i] for i in order]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield the growing output of one prompt after every token (the last one has `finished`)."""
        sampling_params = sampling_params or self.get_default_sampling_params()
        _check_sampling_params(sampling_params)
        request_id = self._add(prompt, sampling_params)
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


# vLLM's constructor arguments that `LLM.__init__` takes besides the EngineConfig fields
VLLM_OPTIONS = ("seed", "trust_remote_code", "tensor_parallel_size", "enforce_eager", "tokenizer")


def _check_sampling_params(params: Any) -> None:
    if not isinstance(params, SamplingParams):
        fix = f"SamplingParams(**{params!r})" if isinstance(params, Mapping) else "SamplingParams(...)"
        raise TypeError(f"sampling_params takes SamplingParams (or a list of them, one per prompt), got "
                        f"{type(params).__name__}: pass {fix}")


def _check_engine_keywords(engine_options: Mapping[str, Any]) -> None:
    """A TypeError naming the keyword and the options there are, not EngineConfig's bare one."""
    fields = [f.name for f in dataclasses.fields(EngineConfig)]
    for name in engine_options:
        if name not in fields:
            close = difflib.get_close_matches(name, fields + list(VLLM_OPTIONS), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}{hint}. It takes model, hal, "
                            f"dtype, tokenizer, engine_config, parallel, stop_token_ids; vLLM's "
                            f"{', '.join(VLLM_OPTIONS[:-1])}; and the engine options of "
                            f"runtime.config.EngineConfig: {', '.join(fields)}")


@functools.cache
def _note_remote_code_unused() -> None:
    log.info("trust_remote_code=True is not needed: loopstack runs its own implementation of the model "
             "(zoo/), no code from the checkpoint")


def _check_tensor_parallel_size(size: Any, parallel: ParallelState) -> None:
    """vLLM starts its tensor-parallel workers itself; here they are torchrun's processes, so past
    the default 1 only the size `parallel` already has is accepted."""
    if not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if size in (1, parallel.world_size):
        return
    raise ValueError(
        f"tensor_parallel_size={size}, but LLM() does not start tensor-parallel workers: loopstack runs one "
        f"process per rank under torchrun (docs/tensor-parallel.md). From the command line: `torchrun "
        f"--nproc-per-node {size} -m runtime.generate model=... parallel.tp={size}` (runtime.serve and "
        f"runtime.bench alike). From a script started by `torchrun --nproc-per-node {size}`: `parallel = "
        f"runtime.parallel.state.init_distributed(hal, {size})`, then `LLM(model, hal=hal, "
        f"parallel=parallel)` on rank 0 (parallel.is_driver) and `runtime.llm.follow(model, hal, dtype, "
        f"parallel)` on the others")


def _tokenizer_at(path: str | os.PathLike) -> Tokenizer:
    folder = Path(path).expanduser()
    tokenizer = Tokenizer.from_folder(folder) if folder.is_dir() else None
    if tokenizer is None:
        what = "has no tokenizer.json" if folder.is_dir() else "is not a folder"
        raise ValueError(f"tokenizer={os.fspath(path)!r} {what}: give the folder that holds a tokenizer.json "
                         f"(e.g. the checkpoint's) or a runtime.text.tokenizer.Tokenizer")
    return tokenizer


def _seed_global_rngs(seed: int) -> None:
    """vLLM's seeding: Python's, NumPy's and torch's (every device's) global generators."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % (1 << 32))           # NumPy's legacy seeds are 32-bit


def _token_ids(prompt: Any) -> list[int]:
    _refuse_bytes(prompt)
    try:
        return [operator.index(t) for t in prompt]
    except TypeError:
        raise TypeError(f"a prompt is a string, a list of token ids or a dict with 'prompt' or "
                        f"'prompt_token_ids', got {type(prompt).__name__}: {str(prompt)[:80]}") from None


def _refuse_bytes(prompt: Any) -> None:
    if isinstance(prompt, (bytes, bytearray, memoryview)):     # would read as token ids, one per byte
        raise TypeError("a prompt is a string or a list of token ids, not bytes: decode it first (b.decode())")


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    _refuse_bytes(prompts)
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
    keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {k: raw[k] for k in keys if raw.get(k) is not None}
