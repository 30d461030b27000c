"""What `LLM.generate` and `LLM.stream` take as prompts and sampling parameters, checked before
anything reaches the engine: a string, token ids (a list of integers, NumPy's or torch's too, or a
1-D array or tensor), vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}` dicts, or a list of
those; one `SamplingParams` for all or one per prompt. Bad input raises naming the form to use."""
from __future__ import annotations

import operator
from typing import Any, Mapping, Sequence, Union

import numpy as np
import torch

from runtime.sampling_params import SamplingParams

Prompt = Union[str, Sequence[int], Mapping[str, Any]]     # ids: a list, a 1-D array or tensor too
PROMPT_FORMS = "a prompt is a string, a list of token ids or a dict with 'prompt' or 'prompt_token_ids'"


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """The prompts of one call: a single prompt becomes a list of one."""
    refuse_bytes(prompts)
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if not hasattr(prompts, "__iter__") or getattr(prompts, "ndim", 1) == 0:
        raise TypeError(f"{PROMPT_FORMS}, or a list of those; got {type(prompts).__name__}: {str(prompts)[:80]}")
    if getattr(prompts, "ndim", None) == 1:             # a NumPy array or torch tensor of ids
        return [prompts]
    prompts = list(prompts)
    if prompts and all(is_token_id(t) for t in prompts):
        return [prompts]                                # one prompt of token ids
    return prompts


def token_ids(prompt: Any) -> list[int]:
    """A prompt's token ids as Python ints (a bool is not a token id)."""
    refuse_bytes(prompt)
    try:
        ids = list(prompt)
        if not all(is_token_id(t) for t in ids):
            raise TypeError
        return [operator.index(t) for t in ids]
    except TypeError:
        raise TypeError(f"{PROMPT_FORMS}, got {type(prompt).__name__}: {str(prompt)[:80]}") from None


def is_token_id(value: Any) -> bool:
    """An integer of Python's, NumPy's or a 0-d integer tensor; True is not one."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, torch.Tensor) and (value.ndim != 0 or value.dtype == torch.bool):
        return False                    # a row of a 2-D tensor is a prompt, even of one id
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def refuse_bytes(prompt: Any) -> None:
    if isinstance(prompt, (bytes, bytearray, memoryview)):     # would read as token ids, one per byte
        raise TypeError("a prompt is a string or a list of token ids, not bytes: decode it first (b.decode())")


def params_list(sampling_params: SamplingParams | Sequence[SamplingParams] | None, num_prompts: int,
                default: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per prompt: `default` for all without any, the one given for all, or the
    list given (as long as the prompts)."""
    params = default if sampling_params is None else sampling_params
    out = list(params) if isinstance(params, (list, tuple)) else [params] * num_prompts
    if len(out) != num_prompts:
        raise ValueError(f"{len(out)} SamplingParams for {num_prompts} prompts: give one for all, or one per prompt")
    for p in out:
        check_sampling_params(p)
    return out


def check_sampling_params(params: Any) -> None:
    if not isinstance(params, SamplingParams):
        fix = f"SamplingParams(**{params!r})" if isinstance(params, Mapping) else "SamplingParams(...)"
        raise TypeError(f"sampling_params takes SamplingParams (or a list of them, one per prompt), got "
                        f"{type(params).__name__}: pass {fix}")
