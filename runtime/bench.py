"""`python -m runtime.bench hal=cuda model=ouro-1.4b weights=random workload=[b1,b64]`: throughput of
the engine per workload cell, next to the roofline floor, one JSON line per cell.

Engine options are the `engine:` node shared with runtime.generate and runtime.serve (README
"Options"). `engine.kv_dtype=fp8` and `engine.weights_dtype=fp8` run the cells over an FP8 KV cache
and FP8 linears (docs/fp8.md); the floors then count the bytes those actually move.

Two memory floors: `decode_vs_floor` divides the bytes by the H200's 4.27 TB/s (the issues' floor),
`decode_vs_measured_floor` by the copy rate measured at start on this device (`copy_tb_s`).

With `engine.speculative.num_tokens=K` (and `.draft_loops`, `.mode`) the cell decodes
speculatively and also reports the acceptance, and the cost of one draft pass, one verify pass and
one plain decode step at the cell's batch with the break-even acceptance rate (runtime/speculation/costs.py).

Random weights are built from the model's released config.json (zoo/configs/) directly on the
device, without a checkpoint file: a fixed-depth forward runs at the same speed on any weights.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from runtime.bench_rows import append_rows
from runtime.bench_profile import late_summary, profile_decode, start_profile, step_costs, stop_profile
from runtime.sampling_params import SamplingParams
from runtime.config import BenchConfig
from runtime.cli import (CONF_DIR, clear_errors, engine_config, make_hal, register_schemas,
                         setup_logging)
from runtime.cli_args import check_argv

log = logging.getLogger("runtime.bench")
CONFIGS = Path(__file__).resolve().parent.parent / "zoo" / "configs"

KERNEL_ENV = ("LOOPSTACK_PDL", "LOOPSTACK_DECODE_PROJECTIONS", "LOOPSTACK_KERNEL_CONFIGS", "LOOPSTACK_MAX_SPLITS",
              "LOOPSTACK_BLASLT", "LOOPSTACK_RING_GEMV", "LOOPSTACK_RING_CONFIGS")
# quoted from issue #5: the checkpoint's own HF remote code on the same H200, Ouro-1.4B bf16
HF_REFERENCE_MS_PER_STEP = {("ouro-1.4b", 1): 130.0, ("ouro-1.4b", 64): 127.0}


def build_model(cfg: Any, device: torch.device, parallel: Any = None):
    """The model (this rank's shard under tensor parallelism: `parallel` from `runtime.parallel.state`)."""
    import zoo
    from zoo.resolve import packaged_checkpoint

    shard_args = parallel.shard_args() if parallel is not None else {}
    if cfg.weights == "random":
        source = cfg.model.path or cfg.model.name
        config = Path(source) / "config.json" if Path(str(source)).is_dir() else CONFIGS / f"{source}.json"
        packaged = packaged_checkpoint(str(source))
        if not config.is_file() and packaged is not None:           # a packaged model's shape (ouro-tiny)
            config = packaged / "config.json"
        if not config.is_file():
            raise ValueError(f"no config for {source!r}: give model=<name with zoo/configs/NAME.json> or "
                             f"model.path=DIR (weights=checkpoint runs a checkpoint's own weights)")
        return zoo.from_config(config, dtype=cfg.model.dtype, device=device, seed=0, **shard_args)
    if cfg.weights == "checkpoint":
        return zoo.from_pretrained(cfg.model.path or cfg.model.name, dtype=cfg.model.dtype, device=device,
                                   **shard_args)
    raise ValueError(f"weights must be 'random' or 'checkpoint', got {cfg.weights!r}")


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
           "prefill_s": round(prefill_done or total, 4), "ttft_ms": round((prefill_done or total) * 1e3, 2),
           "prefill_tok_s": round(cell["batch"] * cell["prompt"] / (prefill_done or total), 1),
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


def workload_names(cfg: Any) -> list[str]:
    """The cells `workload=` names, each checked against `workloads` (before any model is built)."""
    names = cfg.workload if isinstance(cfg.workload, (list, tuple)) or OmegaConf.is_list(cfg.workload) \
        else str(cfg.workload).split(",")
    if not names:
        raise ValueError(f"workload= names no cell; pick some of: {', '.join(cfg.workloads)}")
    if not (isinstance(cfg.matmul_size, int) and cfg.matmul_size >= 1):
        raise ValueError(f"matmul_size must be an integer >= 1 (the matmul that measures the FLOP rate), "
                         f"got {cfg.matmul_size!r}")
    for name in names:
        if name not in cfg.workloads:
            raise ValueError(f"unknown workload {name!r}; known: {', '.join(cfg.workloads)}")
        for key in ("batch", "prompt", "new"):
            value = cfg.workloads[name].get(key)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"workloads.{name}.{key} must be an integer >= 1, got {value!r}")
    return list(names)


def check_options(cfg: Any) -> None:
    """The bench's own options, before any model is built: the cells, `profile=` and `output=` (a
    file that cannot be written would fail only after the first cell had run)."""
    workload_names(cfg)
    if not (isinstance(cfg.profile, int) and cfg.profile >= 0):
        raise ValueError(f"profile must be an integer >= 0 (decode steps of each cell to profile), got {cfg.profile!r}")
    if cfg.output:
        out = Path(str(cfg.output))
        folder = out.parent if str(out.parent) else Path(".")
        if out.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK) \
                or out.exists() and not os.access(out, os.W_OK):
            raise ValueError(f"output={cfg.output} cannot be written (rows are appended to a file): give a file "
                             f"path in a folder that exists and is writable")


def run(cfg: Any) -> list[dict[str, Any]]:
    """Every workload cell (rank 0 of a tensor-parallel run measures; the other ranks follow)."""
    from runtime.parallel.state import init_from_cli
    from runtime.parallel.follower import Follower

    engine_config(cfg)                  # bad options fail before a model is built
    check_options(cfg)
    hal = make_hal(cfg.hal)
    parallel = init_from_cli(hal, cfg)
    try:
        model = build_model(cfg, hal.device(), parallel)
        if not parallel.is_driver:
            with torch.inference_mode():
                Follower(model, hal, parallel.channel).run()
            return []
        return run_cells(cfg, hal, model, parallel)
    finally:
        parallel.shutdown()


def run_cells(cfg: Any, hal: Any, model: Any, parallel: Any) -> list[dict[str, Any]]:
    from runtime.engine.admission import ContextDoesNotFit
    from runtime.engine.llm_engine import LLMEngine
    from runtime.roofline import (H200_BANDWIDTH, decode_floor, measure_copy_rate, measure_matmul_rate, model_costs,
                                  prefill_floor)

    name = Path(str(cfg.model.path)).name if cfg.model.path else cfg.model.name
    num_loops = cfg.model.num_loops or model.default_num_loops
    rate = copy_rate = None
    results = []
    workloads = workload_names(cfg)
    spec = engine_config(cfg).speculative
    lengths = {}
    given = cfg.engine.get("max_model_len")  # a user's own, else each cell's need
    for workload in workloads:               # every cell checked before any runs (or measures)
        cell = cfg.workloads[workload]
        lengths[workload] = (max(cell["prompt"] + cell["new"], cell.get("late_prompt", 0) + 1) + 16
                             + 2 * spec.num_tokens)
        if lengths[workload] > model.max_seq_len:
            raise ValueError(f"workload {workload} needs {lengths[workload]} positions and {name} has "
                             f"{model.max_seq_len}: pick a shorter workload or set "
                             f"workloads.{workload}.prompt=<fewer tokens>")
        if given is not None and given < lengths[workload]:
            raise ValueError(f"workload {workload} needs {lengths[workload]} positions and "
                             f"engine.max_model_len={given}: raise it, or leave it unset for each cell's own")
    for workload in workloads:
        cell = dict(cfg.workloads[workload])
        config = engine_config(
            cfg, max_num_seqs=max(cell["batch"] + (1 if cell.get("late_prompt") else 0), 1),
            max_model_len=given if given is not None else lengths[workload])
        try:
            engine = LLMEngine(model, hal, config, publisher=parallel.publisher())
        except ContextDoesNotFit as exc:
            # the cell's own length, which the user did not set: name the cache, not engine.max_model_len
            if given is not None:
                raise
            raise ValueError(f"workload {workload} needs {lengths[workload]} positions per request, but "
                             f"{exc.where}: raise engine.num_kv_blocks (or free device memory), or shorten "
                             f"workloads.{workload}.prompt / .new") from None
        if rate is None:                 # after the first cell's engine has checked its options
            rate = measure_matmul_rate(hal, model.lm_head.weight.dtype, size=cfg.matmul_size)
            if cfg.matmul_size < 1024:         # the CPU tests' small cells take 64 to save time
                log.warning("matmul_size=%d measures launches more than the FLOP rate: the compute floors and "
                            "the ratios to them (prefill_vs_floor, decode_vs_floor) are not meaningful; use "
                            "1024 or more (8192, the default, on a GPU)", cfg.matmul_size)
            copy_rate = measure_copy_rate(hal)
            log.info("matmul rate %.0f TFLOP/s, copy rate %.2f TB/s", rate / 1e12, copy_rate / 1e12)
        if cfg.warmup:
            # same prompt lengths, a late prompt's too: kernels compile (and passes the engine did not
            # capture at start, such as a long chunk's prefill, capture) outside the timed cell; with
            # several prompts twice, with up to four, since a packed pass captures at its second step of
            # a token count (runtime/execution/packed_steps.py; one prompt never takes a packed step)
            late = {"late_prompt": cell["late_prompt"]} if cell.get("late_prompt") else {}
            for seed in (1, 2) if cell["batch"] > 1 else (1,):
                run_cell(engine, {"batch": min(cell["batch"], 4), "prompt": cell["prompt"], "new": 4, **late},
                         num_loops, seed=seed, exit_threshold=cfg.model.exit_threshold)
        row = {"workload": workload, "model": name, "hal": hal.name, "tp": parallel.world_size,
               "kv_mode": config.kv_mode, "kv_dtype": config.kv_dtype, "weights_dtype": config.weights_dtype,
               # which FP8 GEMM the CUDA Hal was told to use (hal/cuda/fp8.py), for comparing the paths
               **({"fp8_gemm": os.environ.get("LOOPSTACK_FP8_GEMM", "auto")}
                  if config.weights_dtype == "fp8" else {}),
               # kernel switches read from the environment (hal/kernels/pdl.py, hal/cuda/), when set
               **{key.removeprefix("LOOPSTACK_").lower(): os.environ[key] for key in KERNEL_ENV if key in os.environ},
               "max_num_batched_tokens": config.max_num_batched_tokens, "max_model_len": engine.max_model_len,
               "async_scheduling": engine.config.async_scheduling, "wavefront_prefill": config.wavefront_prefill,
               "loops": num_loops, "dtype": cfg.model.dtype, "weights": cfg.weights,
               "graphs": engine.runner.graphs is not None and engine.runner.graphs.capture,
               "start_capture_s": round(engine.runner.start_capture_s, 3),
               "spec": f"K={spec.num_tokens},d={spec.draft_loops},{spec.mode}" if spec.is_enabled else "off",
               **({"exit_threshold": cfg.model.exit_threshold} if cfg.model.exit_threshold is not None else {}),
               **run_cell(engine, cell, num_loops, profile_steps=cfg.profile,
                          profile_prefill=cfg.profile_prefill, exit_threshold=cfg.model.exit_threshold)}
        if spec.is_enabled:
            row.update(step_costs(engine, cell, num_loops))
        runner = engine.runner           # the cache's own bytes per token and layer (8-bit KV: with its scales)
        kv_bytes = runner.bytes_per_block // (runner.block_size * model.kv_spec.layers_per_plane)
        costs = model_costs(model, num_loops, config.kv_mode, kv_bytes)
        context = cell["prompt"] + cell["new"] // 2
        floor = decode_floor(costs, num_loops, cell["batch"], context, H200_BANDWIDTH, rate)
        pre = prefill_floor(costs, num_loops, cell["prompt"], cell["batch"], H200_BANDWIDTH, rate)
        # the issues' floors divide by the H200's copy rate; on another device only the measured one means much
        here = decode_floor(costs, num_loops, cell["batch"], context, copy_rate, rate)
        row.update({"decode_floor_ms": round(floor.seconds * 1e3, 3),
                    "decode_vs_floor": round(row["decode_ms_step"] / (floor.seconds * 1e3), 2),
                    "copy_tb_s": round(copy_rate / 1e12, 3),
                    "decode_vs_measured_floor": round(row["decode_ms_step"] / (here.seconds * 1e3), 2),
                    "prefill_floor_tok_s": round(cell["batch"] * cell["prompt"] / pre.seconds, 1),
                    "prefill_vs_floor": round(pre.seconds / row["prefill_s"], 3),
                    "matmul_tflops": round(rate / 1e12, 1)})
        hf = HF_REFERENCE_MS_PER_STEP.get((name, cell["batch"]))
        if hf and engine.runner.layout.is_exact:
            row["speedup_vs_hf"] = round(hf / row["decode_ms_step"], 1)
        results.append(row)
        print(json.dumps(row), flush=True)
        append_rows(cfg.output, [row])   # now: a call cut short by its time limit keeps the cells done
        engine.close()
        del engine, runner
        gc.collect()                     # a cycle left behind (tests/runtime/test_engine_lifetime.py finds none) frees its memory before the cache empties
        hal.empty_cache()
    return results


register_schemas()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="bench")
def _main(cfg: DictConfig) -> None:
    setup_logging(cfg.log_level)
    with clear_errors(cfg.log_level):
        run(cfg)


def main() -> None:
    check_argv(sys.argv[1:], BenchConfig, "runtime.bench", "bench")
    _main()


if __name__ == "__main__":
    main()
