"""Tensor parallelism on two GPUs: every check in one torchrun launch (tools/tp_check.sh runs it).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/tp_check.py --out DIR

1. greedy: Ouro-1.4B's shape with random bf16 weights, drawn per tensor from one seed, so the TP=2
   shards are exact slices of the TP=1 model. Rank 0 generates alone (TP=1), then both ranks generate
   with their shards (TP=2, decode graphs where the Hal captures collectives). Tokens are compared
   per prompt; also reported: the prompts' dense logits difference and, at a divergence, the TP=1
   top-2 logit margin there (the row-parallel partial sums are rounded to bf16 before the all-reduce,
   so near-ties may flip: the margin says whether that explains it).
2. decode benchmark: `runtime.bench`'s own `run_cells` (the rows `python -m runtime.bench` writes) at
   batch 1 and 64 for Ouro-1.4B and batch 1 for Huginn-0125 at 32 recurrences, TP=1 (rank 0 alone)
   then TP=2, with fewer new tokens than the standard cells (the median step is steady after a few).
3. if the time allows: the greedy check in float32 (whether the sharded math is exact), then the
   golden cases (tests/data/golden: tiny checkpoints, float32) through `runtime.generate`'s own `run`
   at parallel.tp=2 (loading slices from safetensors), against their reference greedy tokens.

Rows are appended to DIR/bench.jsonl and DIR/greedy.jsonl as they come; a table is printed last
(`python tools/tp_check.py --table DIR` prints it again). While rank 0 works alone, rank 1 waits on
the host-side control channel for the next TP=2 task.
"""
from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hal as hal_registry  # noqa: E402
from runtime import SamplingParams  # noqa: E402
from runtime.llm import LLM, follow  # noqa: E402
from runtime.parallel.follower import Follower  # noqa: E402
from runtime.parallel.state import ParallelState, init_distributed  # noqa: E402


class Task(NamedTuple):
    """Rank 0 -> rank 1 on the control channel: what both do next with the shards of `model`."""

    kind: str            # "greedy" | "bench" | "golden" | "done"
    model: str           # key of `configs(...)`; "golden": the case's name


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / ".out" / "tp"))
    p.add_argument("--table", metavar="DIR", help="only print the table of DIR's rows")
    p.add_argument("--hal", default="cuda")
    p.add_argument("--ouro", default="ouro-1.4b", help="a model config name (zoo/configs) or a folder")
    p.add_argument("--huginn", default="huginn-0125")
    p.add_argument("--huginn-loops", type=int, default=32)
    p.add_argument("--cells", default="b1:1x128+64,b64:64x1024+32", help="NAME:BATCHxPROMPT+NEW,...")
    p.add_argument("--huginn-cells", default="b1:1x128+32")
    p.add_argument("--prompts", type=int, default=8, help="greedy check: prompts of --prompt-len tokens")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new", type=int, default=48)
    p.add_argument("--fp32", choices=["auto", "yes", "no"], default="auto",
                   help="the float32 greedy check; auto: if at most --fp32-before-s seconds are spent by then")
    p.add_argument("--fp32-before-s", type=float, default=140.0)
    p.add_argument("--golden", choices=["auto", "yes", "no"], default="auto",
                   help="the golden cases at TP=2; auto: if at most --golden-before-s seconds are spent by then")
    p.add_argument("--golden-before-s", type=float, default=170.0)
    p.add_argument("--graphs", choices=["auto", "false"], default="auto")
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--collective-timeout-s", type=float, default=180.0)
    return p.parse_args()


def cells(spec: str) -> dict[str, dict[str, int]]:
    """"b1:1x128+64" -> {"b1": {"batch": 1, "prompt": 128, "new": 64}}."""
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, shape = item.partition(":")
        batch, _, rest = shape.partition("x")
        prompt, _, new = rest.partition("+")
        out[name] = {"batch": int(batch), "prompt": int(prompt), "new": int(new)}
    return out


def bench_config(args: argparse.Namespace, model: str, dtype: str, workloads: dict, loops: int | None) -> Any:
    """`python -m runtime.bench`'s config for these overrides (Hydra compose, no argv)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    import runtime.bench  # noqa: F401  (registers the config schemas)
    from runtime.cli import CONF_DIR

    chosen = ["model=none", f"model.path={model}"] if Path(model).is_dir() else [f"model={model}"]
    overrides = [f"hal={args.hal}", *chosen, f"model.dtype={dtype}", f"matmul_size={args.matmul_size}",
                 *([f"model.num_loops={loops}"] if loops else []),
                 *(["engine.graphs=false"] if args.graphs == "false" else [])]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose("bench", overrides=overrides)
    with open_dict(cfg):
        cfg.workloads = workloads
        cfg.workload = list(workloads)
    return cfg


def configs(args: argparse.Namespace) -> dict[str, Any]:
    return {"ouro": bench_config(args, args.ouro, "bfloat16", cells(args.cells), None),
            "ouro32": bench_config(args, args.ouro, "float32", {}, None),
            "huginn": bench_config(args, args.huginn, "bfloat16", cells(args.huginn_cells), args.huginn_loops)}


# ----- greedy -------------------------------------------------------------------------------------
def prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.prompts)]


def dense_logits(model: Any, ids: list[list[int]]) -> torch.Tensor:
    """`[B, T, V]` float32 logits of the prompts (a collective forward on a sharded model)."""
    batch = torch.tensor(ids, device=next(model.parameters()).device)
    kwargs = {"init_scale": 0.0} if model.has_initial_state else {}
    with torch.inference_mode():
        return model(batch, **kwargs).logits.float()


def margins(model: Any, ids: list[list[int]], outputs: list[list[int]]) -> list[list[float]]:
    """TP=1 top-1 minus top-2 logit at each generated position (teacher-forced, dense)."""
    result = []
    for prompt, out in zip(ids, outputs):
        top2 = dense_logits(model, [prompt + out[:-1]])[0, len(prompt) - 1:].topk(2, dim=-1).values
        result.append((top2[:, 0] - top2[:, 1]).tolist())
    return result


def generate(model: Any, hal: Any, parallel: ParallelState, args: argparse.Namespace, cfg: Any,
             ids: list[list[int]]) -> tuple[list[list[int]], bool]:
    """Greedy tokens of every prompt through the engine, and whether decode steps were captured."""
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True, init_scale=0.0)
    engine = {"max_num_seqs": len(ids), "max_model_len": args.prompt_len + args.new + 16,
              "kv_cache_memory_bytes": 4 << 30, "graphs": False if cfg.engine.graphs is False else None}
    llm = LLM(model, hal=hal, parallel=parallel, **engine)
    try:
        tokens = [o.token_ids for o in llm.generate(ids, params)]
        graphs = llm.engine.runner.graphs
        return tokens, graphs is not None and graphs.capture
    finally:
        llm.close()


def greedy_report(ref: dict[str, Any], tp: dict[str, Any], cfg: Any) -> dict[str, Any]:
    diff = (ref["logits"] - tp["logits"]).abs().max().item()
    agree = (ref["logits"].argmax(-1) == tp["logits"].argmax(-1)).float().mean().item()
    row = {"model": model_name(cfg), "dtype": cfg.model.dtype, "tp": 2, "graphs": tp["graphs"], "tp1_graphs": ref["graphs"],
           "prompts": len(ref["tokens"]), "new_tokens": len(ref["tokens"][0]),
           "prompt_logits_max_diff": round(diff, 5), "prompt_logits_scale": round(ref["logits"].abs().max().item(), 3),
           "prompt_argmax_agreement": round(agree, 5), "divergences": []}
    for i, (a, b, margin) in enumerate(zip(ref["tokens"], tp["tokens"], ref["margins"])):
        if a != b:
            at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            row["divergences"].append({"prompt": i, "at": at, "margin": round(margin[at], 5),
                                       "smallest_margin_before": round(min(margin[:at] or [float("nan")]), 5)})
    row["identical"] = len(ref["tokens"]) - len(row["divergences"])
    row["verdict"] = "PASS" if not row["divergences"] else "DIVERGED"
    return row


# ----- golden cases through runtime.generate -------------------------------------------------------
GOLDEN = ROOT / "tests" / "data" / "golden"


def golden_names() -> list[str]:
    return sorted(p.name for p in GOLDEN.iterdir() if (p / "golden.json").is_file())


def golden_case(name: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return json.loads((GOLDEN / name / "golden.json").read_text()), load_file(str(GOLDEN / name / "golden.safetensors"))


def golden_generate(name: str, args: argparse.Namespace) -> list[list[int]]:
    """`runtime.generate`'s job at parallel.tp=2 on a golden case (every rank; rank 0 gets the tokens)."""
    from hydra import compose, initialize_config_dir

    from runtime.cli import CONF_DIR
    from runtime.generate import run

    meta, tensors = golden_case(name)
    ids = [tensors[f"prompt_{i}"].tolist() for i in range(meta["num_prompts"])]
    loops = meta.get("greedy_num_steps")
    overrides = [f"hal={args.hal}", "model=none", f"model.path={GOLDEN / name}", f"prompt_ids={ids}",
                 f"max_tokens={meta['greedy_new_tokens']}", "model.dtype=float32", "ignore_eos=true",
                 "temperature=0", "init_scale=0", "parallel.tp=2", *([f"model.num_loops={loops}"] if loops else [])]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose("generate", overrides=overrides)
    return [r["token_ids"] for r in run(cfg)]


def golden_report(name: str, tokens: list[list[int]]) -> dict[str, Any]:
    meta, tensors = golden_case(name)
    expected = [tensors[f"greedy_{i}"].tolist() for i in range(meta["num_prompts"])]
    same = sum(a == b for a, b in zip(tokens, expected))
    return {"golden": name, "tp": 2, "dtype": "float32", "prompts": len(expected), "identical": same,
            "verdict": "PASS" if same == len(expected) else "DIFFERENT"}


# ----- the phases ---------------------------------------------------------------------------------
def model_name(cfg: Any) -> str:
    return Path(str(cfg.model.path)).name if cfg.model.path else cfg.model.name


def build(cfg: Any, hal: Any, parallel: ParallelState) -> Any:
    from runtime.bench import build_model

    return build_model(cfg, hal.device(), parallel)


def release(hal: Any) -> None:
    gc.collect()                        # runners and their graphs reference each other
    hal.empty_cache()


def tp1_greedy(cfg: Any, hal: Any, args: argparse.Namespace) -> dict[str, Any]:
    model = build(cfg, hal, ParallelState())
    ids = prompts(args, model.config.vocab_size)
    ref = {"ids": ids, "logits": dense_logits(model, ids)}
    ref["tokens"], ref["graphs"] = generate(model, hal, ParallelState(), args, cfg, ids)
    ref["margins"] = margins(model, ids, ref["tokens"])
    del model
    release(hal)
    return ref


def tp2_task(task: Task, cfgs: dict[str, Any], hal: Any, parallel: ParallelState, args: argparse.Namespace,
             ref: dict[str, Any] | None) -> Any:
    """Run on every rank: the shards of `task.model`, then rank 0 drives and the others follow."""
    if task.kind == "golden":
        return golden_generate(task.model, args)
    cfg = cfgs[task.model]
    model = build(cfg, hal, parallel)
    try:
        if task.kind == "greedy":
            ids = ref["ids"] if parallel.is_driver else prompts(args, model.config.vocab_size)
            logits = dense_logits(model, ids)                      # collective: every rank
            if not parallel.is_driver:
                return follow(model, hal, None, parallel)
            try:
                tokens, graphs = generate(model, hal, parallel, args, cfg, ids)
            finally:
                parallel.stop_followers()
            return greedy_report(ref, {"logits": logits, "tokens": tokens, "graphs": graphs}, cfg)
        if not parallel.is_driver:
            with torch.inference_mode():
                return Follower(model, hal, parallel.channel).run()
        from runtime.bench import run_cells

        try:
            return run_cells(cfg, hal, model, parallel)
        finally:
            parallel.stop_followers()
    finally:
        del model
        release(hal)


def drive(args: argparse.Namespace, cfgs: dict[str, Any], hal: Any, parallel: ParallelState) -> None:
    """Rank 0: every phase in order; results appended to the output files as they come."""
    from runtime.bench import run_cells

    start, out = time.monotonic(), Path(args.out)

    def tp2(kind: str, key: str, ref: dict[str, Any] | None = None) -> Any:
        task = Task(kind, key)
        parallel.channel.send(task)
        return tp2_task(task, cfgs, hal, parallel, args, ref)

    def log(name: str, row: Any) -> None:
        for r in row if isinstance(row, list) else [row]:
            print(f"[tp_check +{time.monotonic() - start:.0f}s] {json.dumps(r)}", flush=True)
            with open(out / name, "a") as f:
                f.write(json.dumps(r) + "\n")

    def greedy(key: str) -> None:
        ref = tp1_greedy(cfgs[key], hal, args)
        log("greedy.jsonl", tp2("greedy", key, ref))

    def bench(key: str) -> None:
        cfg = cfgs[key]
        done = {r["workload"] for r in _read(out / "bench.jsonl") if r["tp"] == 1 and r["model"] == model_name(cfg)}
        if not set(cfg.workload) <= done:               # a rerun keeps the TP=1 rows it has
            model = build(cfg, hal, ParallelState())
            log("bench.jsonl", run_cells(cfg, hal, model, ParallelState()))
            del model
            release(hal)
        log("bench.jsonl", tp2("bench", key))

    greedy("ouro")
    bench("ouro")
    bench("huginn")
    spent = time.monotonic() - start
    if args.fp32 == "yes" or (args.fp32 == "auto" and spent < args.fp32_before_s):
        greedy("ouro32")
    else:
        print(f"[tp_check] float32 greedy skipped ({spent:.0f}s spent; --fp32 {args.fp32})", flush=True)
    spent = time.monotonic() - start
    if args.golden == "yes" or (args.golden == "auto" and spent < args.golden_before_s):
        for name in golden_names():
            log("greedy.jsonl", golden_report(name, tp2("golden", name)))
    else:
        print(f"[tp_check] golden cases skipped ({spent:.0f}s spent; --golden {args.golden})", flush=True)
    parallel.channel.send(Task("done", ""))


def main() -> None:
    args = parse_args()
    if args.table:
        return print_table(Path(args.table))
    faulthandler.enable()
    faulthandler.register(signal.SIGTERM, chain=True)     # `timeout` ends a hang: say where each rank was
    hal = hal_registry.get(args.hal)
    parallel = init_distributed(hal, int(os.environ.get("WORLD_SIZE", "1")),
                                collective_timeout_s=args.collective_timeout_s)
    if parallel.world_size != 2:
        raise SystemExit("run under torchrun with 2 processes: python -m torch.distributed.run --standalone "
                         "--nproc-per-node 2 tools/tp_check.py")
    cfgs = configs(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    try:
        if parallel.is_driver:
            drive(args, cfgs, hal, parallel)
        else:
            while (task := parallel.channel.recv()).kind != "done":
                tp2_task(task, cfgs, hal, parallel, args, None)
    finally:
        parallel.shutdown()


# ----- the table ----------------------------------------------------------------------------------
def print_table(out: Path) -> None:
    for line in _read(out / "greedy.jsonl"):
        if "golden" in line:
            print(f"golden {line['golden']} float32 TP=2 via runtime.generate: {line['verdict']} "
                  f"{line['identical']}/{line['prompts']} prompts give the reference greedy tokens")
            continue
        print(f"greedy {line['model']} {line['dtype']}: {line['verdict']} {line['identical']}/{line['prompts']} "
              f"prompts identical over {line['new_tokens']} tokens (TP=2 graphs={line['graphs']}); prompt "
              f"logits max |TP=2 - TP=1| {line['prompt_logits_max_diff']} (scale {line['prompt_logits_scale']}), "
              f"argmax agreement {line['prompt_argmax_agreement']}")
        for d in line["divergences"]:
            print(f"    prompt {d['prompt']}: first divergence at token {d['at']}, TP=1 top-2 margin there "
                  f"{d['margin']} (smallest before {d['smallest_margin_before']})")
    rows = {(r["model"], r["loops"], r["workload"], r.get("tp", 1)): r for r in _read(out / "bench.jsonl")}
    print(f"\n{'model':12s} {'loops':>5s} {'cell':5s} {'batch':>5s} {'prompt':>6s} {'tp':>3s} {'graphs':>6s} "
          f"{'ms/step':>8s} {'tok/s':>8s} {'vs floor':>8s} {'peak GiB':>8s} {'TP=1/TP=2':>9s}")
    for (model, loops, cell, tp), r in sorted(rows.items()):
        base = rows.get((model, loops, cell, 1))
        speedup = f"{base['decode_ms_step'] / r['decode_ms_step']:.2f}x" if base and tp != 1 else ""
        print(f"{model:12s} {loops:5d} {cell:5s} {r['batch']:5d} {r['prompt']:6d} {tp:3d} {str(r['graphs']):>6s} "
              f"{r['decode_ms_step']:8.2f} {r['decode_tok_s']:8.1f} {r['decode_vs_floor']:8.2f} "
              f"{r['peak_mem_gib']:8.2f} {speedup:>9s}")
    print("weights: random at the real shape (zoo/configs), per-GPU peak memory; floor per GPU (runtime/roofline.py)")


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


if __name__ == "__main__":
    main()
