"""One benchmark cell's timed loop (`runtime.bench`): its requests prefilled, then decoded step by
step, and the row of what that took: wall and device time per step, time to first token, memory."""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import Any

import torch

from runtime.bench_profile import late_summary, profile_decode, start_profile, stop_profile
from runtime.sampling_params import SamplingParams

log = logging.getLogger("runtime.bench")


def run_cell(engine: Any, cell: dict[str, int], num_loops: int | None, seed: int = 0,
             profile_steps: int = 0, profile_prefill: bool = False,
             exit_threshold: float | None = None) -> dict[str, Any]:
    """Prefill `batch` prompts of `prompt` random tokens, then decode `new` tokens each. With
    `late_prompt: N` one more prompt of N tokens arrives once the batch decodes: its time to first
    token and the decode step time while it prefills are reported (chunked vs wavefront prefill).

    Beside the wall time per decode step, device events around each step's work give the device
    time per step and the time the device sat idle between steps waiting for the host
    (`runtime.execution.step_timer`). `profile_steps > 0` runs that many decode steps of this very
    loop under torch.profiler and prints where the device time went; `profile_prefill` does so for
    the steps from the first until every prompt has its first token on the host (async scheduling:
    with the first decode step, launched before that read, where the cell decodes more than one
    token); its prefill_s then includes the profiler's overhead (the row says `profiled_prefill`)."""
    from runtime.execution.step_timer import StepTimer

    hal = engine.hal
    engine.timer = StepTimer(hal)
    profiler = None
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=cell["new"], temperature=0.0, ignore_eos=True, num_loops=num_loops,
                            exit_threshold=exit_threshold)
    for i in range(cell["batch"]):
        prompt = torch.randint(1, vocab, (cell["prompt"],), generator=gen).tolist()
        engine.add_request(f"bench-{seed}-{i}", prompt, params)
    hal.synchronize()
    hal.reset_peak_memory()
    num_graphs = count_graphs(engine)
    prefill_profiler = start_profile(hal) if profile_prefill else None
    start = time.perf_counter()
    step_times, prefill_done = [], None
    seen: dict[str, int] = {}
    decode_tokens, decode_s, metrics = 0, 0.0, []
    late: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        if not engine.config.async_scheduling:     # async: step() already waits for the step before
            hal.synchronize()
        t1 = time.perf_counter()
        new = sum(len(o.token_ids) - seen.get(o.request_id, 0) for o in outs)
        seen.update({o.request_id: len(o.token_ids) for o in outs})
        metrics += [o.metrics for o in outs if o.finished]
        if prefill_done is None:
            # time to first token: every prompt's first token has reached the host (with async
            # scheduling that is a step after its launch)
            if sum(1 for rid, n in seen.items() if n and not rid.endswith("-late")) < cell["batch"]:
                continue
            prefill_done = t1 - start
            if prefill_profiler is not None:
                prefill_profiler = stop_profile(prefill_profiler, hal, "the prefill")
            if cell.get("late_prompt"):
                prompt = torch.randint(1, vocab, (cell["late_prompt"],), generator=gen).tolist()
                engine.add_request(f"bench-{seed}-late", prompt, dataclasses.replace(params, max_tokens=1))
                late = {"added": time.perf_counter(), "steps": []}
            continue
        if late and "ttft" not in late:
            late["steps"].append(t1 - t0)
            if any(o.request_id.endswith("-late") for o in outs):
                late["ttft"] = t1 - late["added"]
        elif outs:
            step_times.append((t1 - t0, len(outs)))
            decode_tokens, decode_s = decode_tokens + new, decode_s + (t1 - t0)
            profiler = profile_decode(profiler, len(step_times), profile_steps, hal)
    if profiler is not None:
        profile_decode(profiler, 0, 0, hal)
    total = time.perf_counter() - start
    # steady state: steps where every request of the cell decodes (requests that prefilled in
    # later chunks finish later, and the last steps run smaller batches); skip graph captures
    full = [t for t, n in step_times if n == cell["batch"]]
    decode = full[min(2, len(full) // 4):] or full or [float("nan")]
    ms = statistics.median(decode) * 1e3
    mean_tok_s = round(decode_tokens / decode_s if decode_s else 0.0, 1)
    row = {"batch": cell["batch"], "prompt": cell["prompt"], "new_tokens": cell["new"],
           **prefill_fields(cell, prefill_done or total),
           "decode_ms_step": round(ms, 3), "decode_tok_s": round(cell["batch"] / ms * 1e3, 1),
           # tokens over the decode steps' total time: what compares speculation with plain decoding
           "decode_tok_s_mean": mean_tok_s,
           "decode_steps": len(step_times), "full_batch_steps": len(full), "total_s": round(total, 3),
           "preemptions": sum(m.num_preemptions for m in metrics),
           # graphs captured inside the timed cell (each adds its capture to a step's time)
           "captures_in_cell": count_graphs(engine) - num_graphs,
           "peak_mem_gib": round(hal.memory_stats()["peak_allocated"] / 2**30, 2),
           **(late_summary(cell, late) if late else {}),
           **({"profiled_prefill": True} if profile_prefill else {})}     # prefill_s includes the profiler
    if step_times and not full:
        # the KV cache never held the whole batch at once (it ran in waves): no step is the cell's,
        # so its rate is the tokens over the time, and no step time (NaN, so no floor ratio) applies
        row.update({"decode_tok_s": mean_tok_s, "batch_never_full": True,
                    "max_rows_decoded": max(n for _, n in step_times)})
        log.warning("the cell's %d requests never decoded together (at most %d did; %d preemptions), so "
                    "decode_tok_s is its tokens over its time, not a full batch's rate. Either the first "
                    "requests finished before the last began (more new tokens per request, or a larger "
                    "engine.max_num_batched_tokens, prefills them in fewer steps), or the KV cache is too "
                    "small for the cell (lower the batch or free memory)", cell["batch"],
                    row["max_rows_decoded"], row["preemptions"])
    timing = engine.timer.summary(cell["batch"])
    engine.timer = None
    if timing is not None:
        # device time per full decode step, and how long the device waited for the host between steps
        row.update({"device_ms_step": round(timing.device_ms, 3), "device_idle_ms_step": round(timing.idle_ms, 3),
                    "wall_vs_device": round(ms / timing.device_ms, 3)})
    drafted = sum(m.num_draft_tokens for m in metrics)
    if drafted:
        rounds = sum(m.num_spec_rounds for m in metrics)
        row["decode_tok_s"] = row["decode_tok_s_mean"]         # a step yields a varying number of tokens
        row.update({"acceptance_rate": round(sum(m.num_accepted_tokens for m in metrics) / drafted, 4),
                    "mean_accepted_length": round(sum(m.num_accepted_tokens for m in metrics) / rounds, 3)})
    return row


def count_graphs(engine: Any) -> int:
    """How many passes and chains the engine's runner has captured so far (0 where it runs them eagerly)."""
    graphs = engine.runner.graphs
    return 0 if graphs is None or not graphs.capture else len(graphs.captured) + len(graphs.chains)


def median_first_token(engine: Any, cell: dict[str, int], num_loops: int | None, row: dict[str, Any],
                       repeats: int, exit_threshold: float | None = None) -> dict[str, Any]:
    """The cell's prompts `repeats` times in all, each time new random prompts (seeds from 100: none the
    warm-up's or the first run's, so no prefix is shared): the median time to first token in place of the
    first run's `row`, and every sample. A single prompt's first token varies by 3-6% from one run to the
    next on a GPU, as much as the levers that move it."""
    samples = [row["ttft_ms"]]
    for r in range(1, repeats):
        again = run_cell(engine, cell, num_loops, seed=100 + r, exit_threshold=exit_threshold)
        samples.append(again["ttft_ms"])
    return {**prefill_fields(cell, statistics.median(samples) / 1e3), "ttft_ms_samples": samples}


def prefill_fields(cell: dict[str, int], seconds: float) -> dict[str, float]:
    """A row's prompt-phase fields from the seconds until every prompt's first token was on the host."""
    return {"prefill_s": round(seconds, 4), "ttft_ms": round(seconds * 1e3, 2),
            "prefill_tok_s": round(cell["batch"] * cell["prompt"] / seconds, 1)}
