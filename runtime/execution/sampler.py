"""Token sampling on the logits' device: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the exponential race (argmax of p_i / E_i with E_i ~ Exp(1)), which draws exactly
from p; each request's noise comes from its own generator, so a seeded request gets the same
tokens whatever else is in the batch, and the whole batch needs one host sync.
"""
from __future__ import annotations

from typing import Sequence

import torch

from runtime.config import SamplingParams


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A seeded generator for reproducible sampling (and Huginn's random initial states); None (the
    global RNG) without a seed."""
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution `[..., V]` (float32) after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def _race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, requests) -> torch.Tensor:
    """Next tokens `[R]` (int64, on the logits' device, no host sync) for `logits: [R, V]`; each
    request's `params` and `generator` decide its row (greedy rows take the argmax)."""
    return _sample(logits, [r.params for r in requests], [r.generator for r in requests])


def _sample(logits: torch.Tensor, params: Sequence[SamplingParams],
            generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    out = logits.argmax(dim=-1)
    groups: dict[tuple[float, float, int], list[int]] = {}
    for i, p in enumerate(params):
        if not p.is_greedy:
            groups.setdefault((p.temperature, p.top_p, p.top_k), []).append(i)
    for rows in groups.values():
        probs = filtered_probs(logits[rows], params[rows[0]])          # one filter pass per setting
        picked = [_race(probs[j], generators[i]) for j, i in enumerate(rows)]
        out[rows] = torch.stack(picked)
    return out


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of `logits: [R, V]`, as host ints (the one host sync)."""
    return _sample(logits, params, generators).tolist()


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from `logits: [V]` (the same draw `sample_batch` makes for that row)."""
    return sample_batch(logits[None], [params], [generator])[0]
