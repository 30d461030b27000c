"""What `runtime.bench` measures beside a cell's step times, kept apart from the CLI that runs the
cells: torch.profiler over a few decode steps of the benchmark loop (`profile=N`) or over a cell's
prefill (`profile_prefill=true`), the summary of a late prompt's arrival (`late_prompt: N`), and the
speculation step costs (draft, verify and plain decode at the cell's batch). No Hydra here: only the
CLI module reads the config.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from runtime.sampling_params import SamplingParams


PROFILE_FROM_STEP = 8          # decode steps before the profiled ones (graphs captured, caches warm)


def profile_decode(profiler: Any, step: int, num_steps: int, hal: Any) -> Any:
    """Start torch.profiler at decode step PROFILE_FROM_STEP, stop `num_steps` later and print the
    device kernels by total time (the benchmark loop itself, host scheduling included)."""
    if profiler is None and num_steps and step == PROFILE_FROM_STEP:
        return start_profile(hal)
    if profiler is not None and (step == 0 or step >= PROFILE_FROM_STEP + num_steps):
        return stop_profile(profiler, hal, f"{num_steps} decode steps", row_limit=25)
    return profiler


def start_profile(hal: Any) -> Any:
    """torch.profiler running over the host and, on CUDA, the device's kernels (`stop_profile` ends it)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if hal.device().type == "cuda" else [])
    profiler = profile(activities=activities)
    profiler.__enter__()
    profiler.wall_start = time.perf_counter()
    return profiler


def stop_profile(profiler: Any, hal: Any, what: str, row_limit: int = 30) -> None:
    """Wait for the device, stop `profiler` and print torch's table and the compact kernel list of
    `what` ("the prefill", "4 decode steps"); returns None (no profiler running any more)."""
    hal.synchronize()
    wall_ms = (time.perf_counter() - profiler.wall_start) * 1e3
    profiler.__exit__(None, None, None)
    events = profiler.key_averages()
    sort = "cuda_time_total" if hal.device().type == "cuda" else "cpu_time_total"
    print(f"===== profile of {what} of the benchmark loop", flush=True)
    print(events.table(sort_by=sort, row_limit=row_limit, max_name_column_width=60), flush=True)
    print("\n".join(kernel_summary(events, what, wall_ms)), flush=True)
    print("\n".join(timeline_summary(profiler.events(), what)), flush=True)
    return None


def kernel_summary(events: Any, what: str, wall_ms: float, top: int = 30, width: int = 60) -> list[str]:
    """The compact list for docs: the `top` device kernels (names cut to `width` characters, kernels
    whose names agree that far summed), launches, total ms and share of the profiled device time.
    Without device activity (the CPU Hal) the host ops by self CPU time stand in."""
    from torch.autograd import DeviceType

    def self_device_us(e: Any) -> float:      # torch < 2.4 spells it self_cuda_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0

    device = [(e, self_device_us(e)) for e in events
              if e.device_type != DeviceType.CPU and self_device_us(e) > 0]
    rows = device or [(e, e.self_cpu_time_total) for e in events if e.self_cpu_time_total > 0]
    kind = "device kernels" if device else "host ops by self CPU time (no device activity profiled)"
    families: dict[str, list[float]] = {}
    for e, us in rows:
        family = families.setdefault(e.key[:width], [0, 0.0])
        family[0] += e.count
        family[1] += us
    total_ms = sum(us for _, us in families.values()) / 1e3
    lines = [f"----- {kind} of {what}: {total_ms:.3f} ms busy over {wall_ms:.3f} ms wall, "
             f"{sum(n for n, _ in families.values())} launches",
             f"{'kernel':<{width}} {'count':>7} {'total ms':>10} {'share':>7}"]
    for name, (count, us) in sorted(families.items(), key=lambda kv: -kv[1][1])[:top]:
        share = us / 1e3 / total_ms if total_ms else 0.0
        lines.append(f"{name:<{width}} {count:>7} {us / 1e3:>10.3f} {share:>7.1%}")
    return lines


def timeline_summary(events: Any, what: str, top: int = 8) -> list[str]:
    """Where the device sat idle: the host's lead before the first kernel, the idle time between
    kernels (by gap size, and the largest gaps with the kernels either side) and the tail after the
    last one. Kernels on several streams are merged into one busy timeline."""
    from torch.autograd import DeviceType

    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                     if e.device_type != DeviceType.CPU and e.time_range.end > e.time_range.start)
    host = [e.time_range for e in events if e.device_type == DeviceType.CPU]
    if not kernels or not host:
        return [f"----- timeline of {what}: no device kernels profiled"]
    first_host, last_host = min(r.start for r in host), max(r.end for r in host)
    gaps, busy_end, before = [], kernels[0][1], kernels[0][2]
    for start, end, name in kernels[1:]:
        if start > busy_end:
            gaps.append((start - busy_end, before, name))
        if end > busy_end:
            busy_end, before = end, name
    span = busy_end - kernels[0][0]
    idle = sum(g for g, _, _ in gaps)
    bins = [(0, 2), (2, 10), (10, 100), (100, float("inf"))]
    lines = [f"----- timeline of {what}: host lead {(kernels[0][0] - first_host) / 1e3:.3f} ms before the "
             f"first kernel, device span {span / 1e3:.3f} ms, idle inside it {idle / 1e3:.3f} ms in "
             f"{len(gaps)} gaps, host tail {max(last_host - busy_end, 0) / 1e3:.3f} ms after the last kernel"]
    for lo, hi in bins:
        inside = [g for g, _, _ in gaps if lo <= g < hi]
        lines.append(f"  gaps {lo:>4}-{hi:<4} us: {len(inside):>6} gaps, {sum(inside) / 1e3:8.3f} ms")
    for gap, left, right in sorted(gaps, reverse=True)[:top]:
        lines.append(f"  {gap:9.1f} us between {left[:50]} -> {right[:50]}")
    return lines


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
