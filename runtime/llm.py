"""`LLM`: the user-facing facade, `LLM(model, hal="auto").generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
import logging
import os
from typing import Mapping, Sequence, Union

import torch

import hal as hal_registry
import zoo
from hal.base import Hal
from runtime.chat import Message, apply_chat_template
from runtime.config import SamplingParams
from runtime.outputs import RequestOutput
from runtime.reference import generate_reference
from runtime.tokenizer import Tokenizer
from zoo.base import LoopedCausalLM

log = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int]]


class LLM:
    """A looped model on one Hal, with its tokenizer when the checkpoint has one.

    `model` is a checkpoint folder, a known name ("ouro-1.4b", looked up in the local Hugging Face
    cache) or an already built zoo model. `dtype=None` keeps the checkpoint's dtype.
    """

    def __init__(self, model: str | os.PathLike | LoopedCausalLM, hal: str | Hal = "auto",
                 dtype: torch.dtype | str | None = None, tokenizer: Tokenizer | None = None) -> None:
        self.hal = hal_registry.get(hal) if isinstance(hal, str) else hal
        device = self.hal.device()
        if isinstance(model, LoopedCausalLM):
            self.model = model.to(device=device, dtype=zoo.as_dtype(dtype)) if dtype else model.to(device)
            folder = getattr(model, "name_or_path", None)
        else:
            folder = zoo.resolve_checkpoint(model)
            self.model = zoo.from_pretrained(folder, dtype=dtype, device=device)
        self.tokenizer = tokenizer or (Tokenizer.from_folder(folder) if folder else None)
        self._ids = itertools.count()
        log.info("LLM: %s on %s, dtype %s", type(self.model).__name__, device, next(self.model.parameters()).dtype)

    def stop_token_ids(self) -> tuple[int, ...]:
        ids = list(self.model.stop_token_ids())
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: pass token ids (prompt_ids) instead of text")
            ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        return text, ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids). One `SamplingParams` for all, or one each."""
        prompts = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        outputs = []
        for prompt, p in zip(prompts, params_list):
            text, ids = self.encode(prompt)
            tokens, reason, loops = generate_reference(self.model, ids, p, self.stop_token_ids())
            outputs.append(RequestOutput(str(next(self._ids)), text, ids, tokens, self.decode(tokens),
                                         True, reason, loops))
        return outputs

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             enable_thinking: bool = False) -> list[RequestOutput]:
        """Generate the assistant's reply to one conversation (a list of `{"role", "content"}` dicts)
        or to each of several, through the checkpoint's chat template. `enable_thinking` opens the
        reply with `<think>` (thinking checkpoints)."""
        if self.tokenizer is None:
            raise ValueError("chat needs the checkpoint's tokenizer.json and chat template")
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [apply_chat_template(self.tokenizer, conversation, enable_thinking=enable_thinking)
                   for conversation in conversations]
        return self.generate(prompts, sampling_params)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]                                # one prompt of token ids
    return prompts
