"""Token sampling: greedy, temperature, top-k, top-p, with a per-request generator."""
from __future__ import annotations

import torch

from runtime.config import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A seeded generator whenever `seed` is set (sampling, and Huginn's random initial state even
    when greedy); None (the global RNG) without a seed."""
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution `[V]` (float32) after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from `logits: [V]`."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    probs = filtered_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_tokens(logits: torch.Tensor, requests) -> torch.Tensor:
    """Next tokens `[R]` (int64, on the logits' device, no host sync) for `logits: [R, V]`; the same
    draws, in the same order, as `sample_token` row by row."""
    tokens = logits.argmax(-1)
    for i, request in enumerate(requests):
        if not request.params.is_greedy:
            probs = filtered_probs(logits[i], request.params)
            tokens[i:i + 1] = torch.multinomial(probs, 1, generator=request.generator)
    return tokens
