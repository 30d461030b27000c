"""What a speculation round costs against plain decoding, and the acceptance rate at which it pays.

A round with K drafts costs `(K + 1) * t_draft + t_verify (+ t_host)`: K + 1 draft passes (prelude,
`draft_loops` loops and the head, one row per request) and one verify pass (the remaining loops and
the head over K + 1 rows per request). It yields `E` tokens per request, where with each draft
kept independently with probability a (the acceptance rate)

    E(a) = 1 + a + a^2 + ... + a^K = (1 - a^(K+1)) / (1 - a).

Plain decoding yields one token per `t_decode`, so speculation pays when `E(a) * t_decode > t_round`:
the break-even tokens per round are `t_round / t_decode`, and the break-even acceptance rate is the
a that solves E(a) = t_round / t_decode (none when that exceeds K + 1, the most a round can yield).
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch

from runtime.speculation.drafting import draft_tokens
from runtime.engine.step_schedule import ScheduledRequest


def tokens_per_round(acceptance: float, num_drafts: int) -> float:
    """Expected tokens a round yields when each draft is kept with probability `acceptance`."""
    return float(num_drafts + 1) if acceptance >= 1 else (1 - acceptance ** (num_drafts + 1)) / (1 - acceptance)


def break_even_acceptance(round_over_decode: float, num_drafts: int) -> float | None:
    """The acceptance rate at which a round (costing `round_over_decode` plain decode steps) breaks
    even; 0.0 when it pays even if nothing is accepted, None when it never does."""
    if round_over_decode <= 1:
        return 0.0
    if round_over_decode > num_drafts + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):                      # E(a) increases with a: bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_round(mid, num_drafts) < round_over_decode else (lo, mid)
    return (lo + hi) / 2


def _median_ms(hal: Any, fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        hal.synchronize()
        start = time.perf_counter()
        fn()
        hal.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) * 1e3          # the first run warms up


@torch.inference_mode()
def measure_step_costs(engine: Any, repeats: int = 10) -> dict[str, Any]:
    """Median times (ms) on the engine's running requests, which must all be decoding (prefilled):
    one draft pass (`draft_pass_ms`), one verify pass of K + 1 rows per request (`verify_ms`),
    one plain decode step (`decode_ms`) and one whole round (`round_ms`: K + 1 draft passes and
    the verify, up to the host sync, as the engine runs it: one captured chain where the round
    qualifies, then `per_pass_round_ms` is the round pass by pass; `round_sum_ms` is the sum of the
    parts), with the break-even
    tokens per round and acceptance rate from `round_ms / decode_ms`. The passes write KV only at
    positions at or beyond each request's computed tokens (stale by the rollback rule), so the
    requests' state is unchanged. Needs `speculative.num_tokens > 0`."""
    spec, runner, blocks = engine.speculator, engine.runner, engine.blocks
    if spec is None:
        raise ValueError("measure_step_costs needs speculation on (speculative.num_tokens > 0)")
    requests = list(engine.scheduler.running)
    if not requests or any(r.is_prefill for r in requests):
        raise ValueError("measure_step_costs needs running requests that have all finished their prefill")
    num_drafts, loops = spec.config.num_tokens, spec.config.draft_loops
    for r in requests:
        blocks.allocate(r.request_id, r.num_planes, r.num_computed_tokens + num_drafts + 1)
        spec.state_of(r)                               # the per-request state (seed) drafts need
    first = spec._tensor([r.all_token_ids[-1] for r in requests])
    starts = [r.num_computed_tokens for r in requests]

    def draft(k: int, guess: bool):
        return draft_tokens(runner, requests, first, starts, [k] * len(requests), blocks, loops, num_drafts, guess)

    def verify(drafted):
        return spec.verify(drafted, blocks).argmax(-1).tolist()       # the host sync a round ends with

    drafted = draft(num_drafts, False)
    items = [ScheduledRequest(r, 1) for r in requests]
    costs = {"draft_pass_ms": _median_ms(engine.hal, lambda: draft(0, True).guess.tolist(), repeats),
             "verify_ms": _median_ms(engine.hal, lambda: verify(drafted), repeats),
             "decode_ms": _median_ms(engine.hal, lambda: runner.execute(items, blocks), repeats),
             "round_ms": _median_ms(engine.hal, lambda: verify(draft(num_drafts, False)), repeats)}
    if spec._fusable(requests, [num_drafts] * len(requests)):
        # the engine runs such a round as one captured chain (speculator._fused_round): that is its cost
        counters = dataclasses.replace(spec.counters)
        costs["per_pass_round_ms"] = costs["round_ms"]
        costs["round_ms"] = _median_ms(engine.hal, lambda: spec._fused_round(requests, blocks), repeats)
        spec.counters = counters
    ratio = costs["round_ms"] / costs["decode_ms"]
    costs.update({"round_sum_ms": (num_drafts + 1) * costs["draft_pass_ms"] + costs["verify_ms"],
                  "break_even_tokens_per_round": ratio,
                  "break_even_acceptance": break_even_acceptance(ratio, num_drafts)})
    for r in requests:
        blocks.trim(r.request_id, r.num_tokens)
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in costs.items()}
