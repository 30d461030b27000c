"""Which drafted tokens the target keeps, and the token it adds: the acceptance rules of speculative
decoding.

Greedy: the longest prefix of drafted tokens that equal the target's argmax at their position, then
the target's argmax after that prefix; the output is the target's greedy output, token for token.

Seeded sampling: the plain sampler draws a seeded request's token as argmax(p / E), E Exp(1) noise
keyed by (seed, position, token) (runtime/execution/keyed_random.py). The round draws the target's
token after each prefix the same way and keeps the drafts equal to them, as greedy does; the draft
drew with the same noise on its own distribution, so it agrees wherever the two are close. A seeded
request's tokens are then the tokens it samples without speculation, whatever the load and however
the rounds were cut.

Unseeded sampling: rejection sampling (Leviathan et al. 2023, Chen et al. 2023). Draft token x drawn
from the draft distribution q is kept with probability min(1, p(x) / q(x)), p the target distribution; at
the first rejection the token is drawn from the residual max(0, p - q) (normalised); when every
draft is kept, one more token is drawn from p. Each committed token is then distributed exactly as
p, the target's distribution after temperature, top-k and top-p (the same filtering as
`runtime.execution.sampler`).

The random numbers are keyed by (request seed, token position, purpose) rather than drawn from a
stream, so they do not depend on how the work was cut into rounds: the async mode, which drafts a
round ahead and sometimes throws that work away, samples exactly the tokens the sync mode samples.
A key is used for at most one committed token: drafts at a position are redrawn with the same key
only after the tokens that used it were discarded, and nothing committed depended on them.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

DRAFT, ACCEPT, FINAL = 0, 1, 2       # purposes of a keyed uniform
_MASK = (1 << 64) - 1


def _mix64(x: int) -> int:
    """The splitmix64 finaliser: a bijection of 64-bit integers that scrambles every bit."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def keyed_uniform(seed: int, position: int, purpose: int) -> float:
    """A uniform number in [0, 1) fixed by `(seed, position, purpose)`; 24 bits, so it is exact in
    float32 and strictly below 1 there too."""
    h = _mix64(_mix64(_mix64(seed & _MASK) ^ position) ^ purpose)
    return (h >> 40) / float(1 << 24)


def keyed_uniforms(seeds: Sequence[int], positions: Sequence[Sequence[int]], purpose: int,
                   device: torch.device) -> torch.Tensor:
    """`[len(seeds), len(positions[0])]` float32: row i keyed by `seeds[i]` at `positions[i]`."""
    rows = [[keyed_uniform(s, p, purpose) for p in ps] for s, ps in zip(seeds, positions)]
    return torch.tensor(rows, dtype=torch.float32).to(device, non_blocking=True)


def sample_with_uniform(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row: `probs: [R, V]` (any non-negative weights), `u: [R]` in [0, 1) ->
    `[R]` int64. A token of zero weight is never chosen (its CDF interval is empty)."""
    cdf = probs.float().cumsum(-1)                                        # [R, V]
    total = cdf[:, -1:]
    # u * total may round up to total; the largest float below it still lands on a positive token
    target = torch.minimum(u.float()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def coupled_tokens(probs: torch.Tensor, seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """`[R]` int64: row r's token argmax(probs[r] / E), E the plain sampler's keyed Exp(1) noise at
    (seeds[r], positions[r]) (`runtime.execution.sampler.sample` on a seeded row draws the same)."""
    from runtime.execution.keyed_random import keyed_exponentials

    device = probs.device
    noise = keyed_exponentials(torch.tensor(list(seeds), dtype=torch.long).to(device),
                               torch.tensor(list(positions), dtype=torch.long).to(device), probs.shape[-1])
    return (probs.float() / noise).argmax(dim=-1)


def accept_greedy(draft_tokens: Sequence[int], target_tokens: Sequence[int]) -> int:
    """Drafted tokens the target accepts: the longest prefix with `draft_tokens[j] == target_tokens[j]`
    (`target_tokens[j]`: the target's argmax after the first j drafts; one more than the drafts)."""
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_tokens[n]:
        n += 1
    return n


class Verdict(NamedTuple):
    num_accepted: torch.Tensor      # [B] int64: drafts kept
    final_token: torch.Tensor       # [B] int64: the token drawn after them (residual or bonus)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                     num_drafts: torch.Tensor, u_accept: torch.Tensor, u_final: torch.Tensor) -> Verdict:
    """Rejection sampling for B requests at once, on the device (no host sync).

    `target_probs: [B, K+1, V]` the target's distribution after each prefix (row j: after j drafts);
    `draft_probs: [B, K, V]` the distributions the drafts were drawn from; `draft_tokens: [B, K]`;
    `num_drafts: [B]` (k <= K; rows past a request's k are padding); `u_accept: [B, K]` and
    `u_final: [B, K+1]` uniforms (the final token's uniform is picked by its position).
    """
    num_seqs, max_drafts = draft_tokens.shape
    p = target_probs[:, :max_drafts].gather(-1, draft_tokens[..., None])[..., 0]     # [B, K]
    q = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]                     # [B, K]
    j = torch.arange(max_drafts, device=draft_tokens.device)
    # keep with probability min(1, p/q): u < p/q, written without a division (q > 0: x was drawn from q)
    kept = (u_accept * q < p) & (j[None, :] < num_drafts[:, None])
    n = kept.long().cumprod(-1).sum(-1)                                             # [B]
    rows = torch.arange(num_seqs, device=n.device)
    p_n = target_probs[rows, n]                                                     # [B, V]
    rejected = (n < num_drafts)[:, None]
    q_n = draft_probs[rows, n.clamp(max=max_drafts - 1)] * rejected                 # 0 after the last draft
    residual = (p_n - q_n).clamp_min(0)
    # p == q leaves no residual mass, but then nothing is ever rejected; guard against rounding
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_n)
    return Verdict(n, sample_with_uniform(residual, u_final.gather(1, n[:, None])[:, 0]))


class RoundVerdict(NamedTuple):
    drafts: list[list[int]]     # per request: its k drafted tokens
    num_accepted: list[int]     # drafts kept
    final_tokens: list[int]     # the target's token after them
    guesses: list[int]          # the draft's token after its last draft (async), else -1


def judge_round(draft, logits: torch.Tensor) -> RoundVerdict:
    """Apply the acceptance rules to a round: `draft` a `runtime.speculation.drafting.DraftBatch`, `logits: [N, V]`
    the target's logits of its k + 1 positions per request, packed. One host sync for the batch."""
    offsets = [0]
    for k in draft.num_drafts:
        offsets.append(offsets[-1] + k + 1)
    sampled = [b for b, r in enumerate(draft.requests) if not r.params.is_greedy and r.params.seed is None]
    seeded = [b for b, r in enumerate(draft.requests) if not r.params.is_greedy and r.params.seed is not None]
    targets_of = logits.argmax(-1)
    if seeded:                              # their targets are the keyed draws, not the argmax
        rows = [offsets[b] + j for b in seeded for j in range(draft.num_drafts[b] + 1)]
        from runtime.execution.sampler import filtered_probs

        probs = torch.cat([filtered_probs(logits[offsets[b]:offsets[b + 1]], draft.requests[b].params)
                           for b in seeded])
        positions = [draft.starts[b] + j + 1 for b in seeded for j in range(draft.num_drafts[b] + 1)]
        seeds = [draft.requests[b].params.seed for b in seeded for _ in range(draft.num_drafts[b] + 1)]
        targets_of[_long(rows, logits.device)] = coupled_tokens(probs, seeds, positions)
    parts = [draft.tokens.flatten(), targets_of]
    if draft.guess is not None:
        parts.append(draft.guess)
    if sampled:
        parts.extend(_rejection_sample(draft, logits, offsets, sampled))
    host = torch.cat(parts).tolist()
    width, num_seqs = draft.tokens.shape[1], len(draft.requests)
    drafts = [host[b * width:b * width + k] for b, k in enumerate(draft.num_drafts)]
    at = num_seqs * width
    targets, at = host[at:at + offsets[-1]], at + offsets[-1]
    guesses = [-1] * num_seqs
    if draft.guess is not None:
        guesses, at = host[at:at + num_seqs], at + num_seqs
    num_accepted, finals = [0] * num_seqs, [0] * num_seqs
    for b, k in enumerate(draft.num_drafts):
        target = targets[offsets[b]:offsets[b] + k + 1]
        num_accepted[b] = accept_greedy(drafts[b], target)
        finals[b] = target[num_accepted[b]]
    for i, b in enumerate(sampled):                         # unseeded sampling: rejection sampling instead
        num_accepted[b], finals[b] = host[at + i], host[at + len(sampled) + i]
    return RoundVerdict(drafts, num_accepted, finals, guesses)


def _rejection_sample(draft, logits: torch.Tensor, offsets: list[int], sampled: list[int]) -> list[torch.Tensor]:
    from runtime.execution.sampler import filtered_probs

    device, width = logits.device, draft.tokens.shape[1]
    target = logits.new_zeros(len(sampled), width + 1, logits.shape[-1])              # [S, K+1, V]
    for i, b in enumerate(sampled):
        params = draft.requests[b].params
        for j in range(draft.num_drafts[b] + 1):
            target[i, j] = filtered_probs(logits[offsets[b] + j], params)
    rows = _long(sampled, device)
    num_drafts = _long([draft.num_drafts[b] for b in sampled], device)
    seeds = [draft.requests[b].speculation.seed for b in sampled]
    positions = [[draft.starts[b] + j + 1 for j in range(width + 1)] for b in sampled]
    verdict = rejection_sample(target, draft.probs.index_select(0, rows), draft.tokens.index_select(0, rows),
                               num_drafts, keyed_uniforms(seeds, [p[:width] for p in positions], ACCEPT, device),
                               keyed_uniforms(seeds, positions, FINAL, device))
    return [verdict.num_accepted, verdict.final_token]


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
