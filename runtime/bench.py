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

A cell with `repeats: N` (conf/bench.yaml: ttft1k, prefill8k) runs its prompts N times, new ones each
time, and reports the median time to first token with every sample (`ttft_ms_samples`).

Random weights are built from the model's released config.json (zoo/configs/) directly on the
device, without a checkpoint file: a fixed-depth forward runs at the same speed on any weights.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from runtime.bench_cell import median_first_token, run_cell
from runtime.bench_rows import append_rows
from runtime.bench_profile import step_costs
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
        repeats = cfg.workloads[name].get("repeats", 1)
        if not (isinstance(repeats, int) and repeats >= 1):
            raise ValueError(f"workloads.{name}.repeats must be an integer >= 1 (how many times its prompts "
                             f"run for the median time to first token), got {repeats!r}")
        if repeats > 1 and cfg.workloads[name].get("late_prompt"):
            raise ValueError(f"workloads.{name} has a late_prompt, whose first token is timed once: drop "
                             f"workloads.{name}.repeats or the late_prompt")
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
        repeats = cell.pop("repeats", 1)
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
        if repeats > 1 and not cfg.profile_prefill:    # (a profiled first run's prefill is not the others')
            row.update(median_first_token(engine, cell, num_loops, row, repeats, cfg.model.exit_threshold))
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
