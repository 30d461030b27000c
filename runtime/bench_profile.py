"""What `runtime.bench` measures beside a cell's step times, kept apart from the CLI that runs the
cells: torch.profiler over a few decode steps of the benchmark loop (`profile=N`), the summary of a
late prompt's arrival (`late_prompt: N`), and the speculation step costs (draft, verify and plain
decode at the cell's batch). No Hydra here: only the CLI module reads the config.
"""
from __future__ import annotations

import statistics
from typing import Any

import torch

from runtime.sampling_params import SamplingParams


PROFILE_FROM_STEP = 8          # decode steps before the profiled ones (graphs captured, caches warm)


def profile_decode(profiler: Any, step: int, num_steps: int, hal: Any) -> Any:
    """Start torch.profiler at decode step PROFILE_FROM_STEP, stop `num_steps` later and print the
    device kernels by total time (the benchmark loop itself, host scheduling included)."""
    from torch.profiler import ProfilerActivity, profile

    if profiler is None and num_steps and step == PROFILE_FROM_STEP:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if hal.device().type == "cuda" else [])
        profiler = profile(activities=activities)
        profiler.__enter__()
        return profiler
    if profiler is not None and (step == 0 or step >= PROFILE_FROM_STEP + num_steps):
        hal.synchronize()
        profiler.__exit__(None, None, None)
        sort = "cuda_time_total" if hal.device().type == "cuda" else "cpu_time_total"
        print(f"===== profile of {num_steps} decode steps of the benchmark loop", flush=True)
        print(profiler.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60), flush=True)
        return None
    return profiler


def late_summary(cell: dict[str, int], late: dict[str, Any]) -> dict[str, Any]:
    during = statistics.median(late["steps"] or [float("nan")])
    return {"late_prompt": cell["late_prompt"], "late_ttft_s": round(late.get("ttft", float("nan")), 4),
            "decode_ms_step_during_late": round(during * 1e3, 3)}


def step_costs(engine: Any, cell: dict[str, int], num_loops: int | None, repeats: int = 10) -> dict[str, Any]:
    """Speculation: one draft pass, one verify pass and one plain decode step at the cell's batch and
    prompt length (runtime/speculation/costs.py), on prefilled requests that are then dropped."""
    from runtime.speculation.costs import measure_step_costs

    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(max_tokens=cell["new"] + 1, temperature=0.0, ignore_eos=True, num_loops=num_loops)
    ids = [f"costs-{i}" for i in range(cell["batch"])]
    for rid in ids:
        engine.add_request(rid, torch.randint(1, engine.model.config.vocab_size, (cell["prompt"],),
                                              generator=gen).tolist(), params)
    while engine.scheduler.waiting or any(r.is_prefill for r in engine.scheduler.running):
        engine.step()
    costs = measure_step_costs(engine, repeats)
    for rid in ids:
        engine.abort(rid)
    return costs
