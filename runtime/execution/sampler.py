"""Token sampling for a whole batch on the logits' device, with no per-row Python in the math.

Two parts, kept apart so a persistent batch keeps the first as device tensors, written when a row
joins and gathered by row index (runtime/execution/row_sampling.py):
- `SamplingTensors.build(rows, device, vocab_size)`: every per-row setting as a tensor (temperature,
  top-k, top-p, penalties, logit bias, min_tokens' banned stop tokens, seeds and positions), plus
  host flags that skip stages no row uses, from the rows' Python objects (steps outside the
  persistent batch, and rows whose penalties or bias need their history);
- `sample(logits, tensors)`: logit processors, then greedy or the exponential race over the
  filtered distribution (argmax of p_i / E_i with E_i ~ Exp(1), which draws exactly from p).

The noise of a seeded row is keyed by (seed, position, token) (runtime/execution/keyed_random.py):
its tokens do not depend on the rest of the batch. Unseeded rows use the device's global RNG.
Log-probabilities (`logprobs`) come from the model's own distribution, log_softmax of the raw logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from runtime.sampling_params import SamplingParams
from runtime.engine.outputs import TokenLogprobs
from runtime.execution.keyed_random import keyed_exponentials

PLACEHOLDER = -1      # runtime.engine.sequence.PLACEHOLDER: a token still on the device (async scheduling)
# logits a penalty or a temperature pushed past float32 stop here: an inf would make softmax NaN
FLOAT32_MAX = torch.finfo(torch.float32).max


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A seeded generator for Huginn's random initial states; None (the global RNG) without a seed.
    (Sampling itself uses keyed noise, not this generator.)"""
    if params.seed is None:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed)
    return gen


class Penalties(NamedTuple):
    presence: torch.Tensor       # [R] float32
    frequency: torch.Tensor      # [R] float32
    repetition: torch.Tensor     # [R] float32 (1 = off)
    output_ids: torch.Tensor     # [R, L] int64 generated tokens, padded with vocab_size
    prompt_ids: torch.Tensor     # [R, P] int64 prompt tokens, padded with vocab_size


@dataclass(frozen=True)
class SamplingTensors:
    """The per-row settings of one batch of R rows, on the device."""

    # None when every row is greedy (only the processors below apply)
    temperature: torch.Tensor | None     # [R] float32; 1.0 on greedy rows (never divided by 0)
    greedy: torch.Tensor                 # [R] bool
    top_k: torch.Tensor                  # [R] int64; <= 0 or >= V: off
    top_p: torch.Tensor                  # [R] float32; 1.0: off
    seeded: torch.Tensor                 # [R] bool
    seeds: torch.Tensor                  # [R] int64 (0 on unseeded rows)
    positions: torch.Tensor              # [R] int64: the position of the token each row samples
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None     # (rows, tokens, values)
    # (rows, tokens) masked to -inf, or a [R, V] bool mask (a persistent batch's min_tokens, row_sampling.py)
    banned: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None
    penalties: Penalties | None
    # host facts: stages no row needs are skipped
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_seeded: bool
    any_unseeded: bool
    min_p: torch.Tensor | None = None    # [R] float32; 0.0: off
    any_min_p: bool = False

    @classmethod
    def build(cls, rows: Sequence[Any], device: torch.device, vocab_size: int,
              pending: Any = None) -> "SamplingTensors":
        """The tensors for `rows`: objects with `params`, `prompt_token_ids` (optionally also as a
        numpy `prompt_array`), `output_token_ids` and `stop_token_ids` (the engine's stops, which
        `min_tokens` holds back with the request's own). Async scheduling: an output token still on
        the device (a placeholder) is taken from `pending` (the `PendingStep` that sampled it) for
        the penalties."""
        params = [r.params for r in rows]
        sampled = [not p.is_greedy for p in params]

        def tensor(values: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)

        bias = banned = penalties = None
        bias_items = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias if t < vocab_size]
        if bias_items:
            r, t, b = zip(*bias_items)
            bias = (tensor(list(r), torch.long), tensor(list(t), torch.long), tensor(list(b), torch.float32))
        ban_items = [(i, t) for i, (row, p) in enumerate(zip(rows, params))
                     if len(row.output_token_ids) < p.min_tokens
                     for t in sorted(set(p.stop_token_ids) | set(row.stop_token_ids)) if 0 <= t < vocab_size]
        if ban_items:
            r, t = zip(*ban_items)
            banned = (tensor(list(r), torch.long), tensor(list(t), torch.long))
        if any(p.has_penalties for p in params):
            penalties = _penalties(rows, params, vocab_size, tensor, pending)
        top_k = [p.top_k if s else 0 for p, s in zip(params, sampled)]
        top_p = [p.top_p if s else 1.0 for p, s in zip(params, sampled)]
        min_p = [p.min_p if s else 0.0 for p, s in zip(params, sampled)]
        seeds = [p.seed if (s and p.seed is not None) else None for p, s in zip(params, sampled)]
        flags = dict(all_greedy=not any(sampled), any_top_k=any(0 < k < vocab_size for k in top_k),
                     any_top_p=any(p < 1.0 for p in top_p), any_min_p=any(p > 0.0 for p in min_p),
                     any_seeded=any(s is not None for s in seeds),
                     any_unseeded=any(s and seed is None for s, seed in zip(sampled, seeds)))
        if flags["all_greedy"]:              # the argmax needs no per-row tensors (no copies to the device)
            return cls(None, None, None, None, None, None, None, bias, banned, penalties, **flags)
        # two host-to-device copies for the per-row values: one float32, one int64 table
        floats = tensor([[p.temperature if s else 1.0, tp, float(not s), mp]
                         for p, s, tp, mp in zip(params, sampled, top_p, min_p)], torch.float32)
        ints = tensor([[k, s or 0, int(s is not None), len(r.prompt_token_ids) + len(r.output_token_ids)]
                       for k, s, r in zip(top_k, seeds, rows)], torch.long)
        return cls(temperature=floats[:, 0], greedy=floats[:, 2] > 0, top_k=ints[:, 0], top_p=floats[:, 1],
                   seeded=ints[:, 2] > 0, seeds=ints[:, 1], positions=ints[:, 3], bias=bias, banned=banned,
                   penalties=penalties, min_p=floats[:, 3], **flags)


def _penalties(rows: Sequence[Any], params: Sequence[SamplingParams], vocab_size: int, tensor,
               pending: Any) -> Penalties:
    def padded(seqs: list[Sequence[int] | np.ndarray]) -> np.ndarray:
        # numpy rows, not Python lists: a batch of 64 1K-token prompts is 64K ids every step
        table = np.full((len(seqs), max(map(len, seqs), default=0) or 1), vocab_size, dtype=np.int64)
        for i, seq in enumerate(seqs):
            table[i, :len(seq)] = seq
        return table

    outputs = padded([r.output_token_ids if p.has_penalties else () for r, p in zip(rows, params)])
    # a Request keeps its prompt as an array (runtime/engine/sequence.py); other rows convert theirs
    prompts = padded([getattr(r, "prompt_array", r.prompt_token_ids) if p.repetition_penalty != 1 else ()
                      for r, p in zip(rows, params)])
    fed_rows, fed_cols = np.nonzero(outputs == PLACEHOLDER)
    outputs[fed_rows, fed_cols] = vocab_size
    output_ids = tensor(outputs, torch.long)
    if len(fed_rows):            # tokens sampled by the step still in flight: copied on the device
        if pending is None:
            raise RuntimeError("a placeholder output token without the step that samples it "
                               "(an async scheduling bug)")
        where = tensor(fed_rows * outputs.shape[1] + fed_cols, torch.long)
        src = tensor([pending.row_of[rows[i].request_id] for i in fed_rows.tolist()], torch.long)
        output_ids.view(-1).index_copy_(0, where, pending.tokens.index_select(0, src))
    return Penalties(tensor([p.presence_penalty for p in params], torch.float32),
                     tensor([p.frequency_penalty for p in params], torch.float32),
                     tensor([p.repetition_penalty for p in params], torch.float32),
                     output_ids, tensor(prompts, torch.long))


# ----- the math: no per-row Python below this line ---------------------------------------------
def apply_processors(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """`logits: [R, V]` float32 after logit_bias, min_tokens, repetition / frequency / presence
    penalties (the order of `SamplingParams`'s docstring); a new tensor."""
    if t.bias is not None:
        logits = logits.index_put(t.bias[:2], t.bias[2], accumulate=True)
    if isinstance(t.banned, torch.Tensor):
        logits = logits.masked_fill(t.banned, float("-inf"))
    elif t.banned is not None:
        logits = logits.index_put(t.banned, torch.full((), float("-inf"), device=logits.device))
    if t.penalties is not None:
        p = t.penalties
        num_rows, vocab = logits.shape
        counts = torch.zeros(num_rows, vocab + 1, device=logits.device)
        counts.scatter_add_(1, p.output_ids, torch.ones_like(p.output_ids, dtype=counts.dtype))
        counts = counts[:, :vocab]
        in_prompt = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        in_prompt.scatter_(1, p.prompt_ids, True)
        seen = in_prompt[:, :vocab] | (counts > 0)
        rep = p.repetition[:, None]
        # past float32 both ways a logit stops at its largest value; only a banned one is -inf
        penalised = torch.where(logits > 0, logits / rep, logits * rep).clamp(-FLOAT32_MAX, FLOAT32_MAX)
        logits = torch.where(seen & ~logits.isneginf(), penalised, logits)
        logits = logits - p.frequency[:, None] * counts - p.presence[:, None] * (counts > 0)
    return logits


def probabilities(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  use_top_k: bool = True, use_top_p: bool = True,
                  min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The sampling distribution `[R, V]` (float32) after temperature, min-p (tokens whose
    probability is below min_p times the top token's dropped; `min_p` None: no row uses it), top-k
    (ties with the k-th logit kept) and top-p (the smallest prefix of the sorted distribution whose
    mass reaches top_p, at least the top token), renormalised."""
    scaled = (logits.float() / temperature[:, None]).clamp(-FLOAT32_MAX, FLOAT32_MAX)
    logits = torch.where(logits.isneginf(), logits, scaled)      # only what was banned stays -inf
    if min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))     # the top token always stays
    vocab = logits.shape[-1]
    order = None
    if use_top_k or use_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    if use_top_k:
        active = (top_k > 0) & (top_k < vocab)
        kth = sorted_logits.gather(1, (top_k - 1).clamp(0, vocab - 1)[:, None])
        logits = logits.masked_fill(active[:, None] & (logits < kth), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if use_top_p:
        sorted_probs = probs.gather(1, order)
        drop = (sorted_probs.cumsum(-1) - sorted_probs >= top_p[:, None]) & (top_p < 1.0)[:, None]
        drop[:, 0] = False         # the top token stays, also where top_p rounded to 0 in float32 (1e-300)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Next tokens `[R]` (int64, on the logits' device, no host sync) for `logits: [R, V]`."""
    logits = logits.float()
    if t.bias is not None or t.banned is not None or t.penalties is not None:
        logits = apply_processors(logits, t)
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy
    probs = probabilities(logits, t.temperature, t.top_k, t.top_p, t.any_top_k, t.any_top_p,
                          t.min_p if t.any_min_p else None)
    noise = torch.empty_like(probs).exponential_() if t.any_unseeded else None
    if t.any_seeded:
        keyed = keyed_exponentials(t.seeds, t.positions, probs.shape[-1])
        noise = keyed if noise is None else torch.where(t.seeded[:, None], keyed, noise)
    return torch.where(t.greedy, greedy, (probs / noise).argmax(dim=-1))


class LogprobsTensors(NamedTuple):
    """Log-probabilities of L rows on the device (`compute_logprobs`); `to_host` reads them."""

    token_ids: torch.Tensor      # [L] the token at each row's position
    logprobs: torch.Tensor       # [L]
    ranks: torch.Tensor          # [L] 1 = most likely
    top_ids: torch.Tensor        # [L, K]
    top_logprobs: torch.Tensor   # [L, K]

    def to_host(self, ks: Sequence[int]) -> list[TokenLogprobs]:
        """One `TokenLogprobs` per row, with the top `ks[i]` tokens (one host sync)."""
        ids, lps, ranks = self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()
        top_ids, top_lps = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [TokenLogprobs(ids[i], lps[i], ranks[i], tuple(zip(top_ids[i][:k], top_lps[i][:k])))
                for i, k in enumerate(ks)]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Log-probabilities under `logits: [L, V]` of `token_ids: [L]`, their ranks and the top `k`."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(-1) + 1
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return LogprobsTensors(token_ids, chosen[:, 0], ranks, top.indices, top.values)


# ----- one request or one distribution (the reference path, speculation) ------------------------
class _Row(NamedTuple):
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_token_ids: Sequence[int] = ()


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution `[..., V]` (float32) of one request's settings after temperature,
    top-k and top-p (speculation's draft and target distributions)."""
    flat = logits.reshape(-1, logits.shape[-1])
    rows = flat.shape[0]
    full = lambda value, dtype: torch.full((rows,), value, dtype=dtype, device=logits.device)  # noqa: E731
    vocab = logits.shape[-1]
    probs = probabilities(flat, full(params.temperature or 1.0, torch.float32), full(params.top_k, torch.long),
                          full(params.top_p, torch.float32), 0 < params.top_k < vocab, params.top_p < 1.0,
                          full(params.min_p, torch.float32) if params.min_p > 0 else None)
    return probs.reshape(logits.shape)


def sample_token(logits: torch.Tensor, params: SamplingParams, prompt_token_ids: Sequence[int] = (),
                 output_token_ids: Sequence[int] = (), stop_token_ids: Sequence[int] = ()) -> int:
    """One token from `logits: [V]` for a request whose prompt and outputs so far are given: the
    same draw `sample` makes for that row in any batch."""
    row = _Row(params, prompt_token_ids, output_token_ids, stop_token_ids)
    t = SamplingTensors.build([row], logits.device, logits.shape[-1])
    return int(sample(logits[None], t)[0])
