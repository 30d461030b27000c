"""Where the host time of a step of prompt chunks beside decodes goes, on the device: the burst
`runtime.bench` times as lever 108's eager side (N prompts of C tokens at a step budget of B tokens,
so each step packs two 1K chunks and the decodes beside them into one pass): with `--eager` the eager
pass, by default the packed captured pass that replaced it (lever 109, runtime/execution/packed_steps.py).

    python tools/eager_host_cost.py [--hal cuda] [--model ouro-1.4b] [--requests 64] [--context 1024]
                                    [--budget 2048] [--top 30] [--eager]

Why: the forty-second session's profile put such a step's host at about 70 ms against 49 ms of kernels
on an H100 (docs/performance.md), and under the profiler no per-call cost can be trusted. Here:
1. each eager step runs with the device idle at its start (a synchronisation before it): the time
   `engine.step()` takes to return is its host's work (and any wait for the device inside it), the
   time until the device is done after it its whole cost;
2. one eager step under `torch.cuda.set_sync_debug_mode("warn")`: every operation that makes the host
   wait for the device, with where it was called;
3. the burst again under cProfile: the functions whose own time (tottime) adds up to the host's;
4. the host time of one call of the step's GEMMs (`F.linear` at the packed step's rows) issued back
   to back, the queue never full, so each call's time is what the host spends issuing it.
Random weights at the model's real shapes (bf16); the prompts are distinct token runs.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import hal
import zoo
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.execution.runner import ModelRunner
from runtime.sampling_params import SamplingParams

CONFIGS = Path(__file__).resolve().parent.parent / "zoo" / "configs"


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class EagerSteps:
    """Counts the steps of prompt chunks that run as one pass inside `engine.step()` calls: eager
    passes, or with packed steps on (the default) packed passes (`ModelRunner._execute_packed`)."""

    def __init__(self, packed: bool) -> None:
        self.count = 0
        if not packed:
            ModelRunner.packed_step = lambda runner, scheduled: None
        name = "_execute_packed" if packed else "_execute_eager"
        original = getattr(ModelRunner, name)
        probe = self

        def counted(runner, *args, **kwargs):
            probe.count += 1
            return original(runner, *args, **kwargs)
        setattr(ModelRunner, name, counted)


def add_burst(engine: LLMEngine, tag: str, num_requests: int, context: int, vocab: int) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"{tag}{i}", [(i * 131 + j * 7) % (vocab - 2) + 1 for j in range(context)], params)


def burst(engine: LLMEngine, eager: EagerSteps, synced: bool, profiler: cProfile.Profile | None = None) -> list:
    """Runs the engine until idle -> (host ms, whole ms) of each step that ran the measured pass."""
    rows = []
    while engine.has_unfinished_requests():
        if synced:
            synchronize()
        before = eager.count
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        engine.step()
        if profiler is not None:
            profiler.disable()
        returned = time.perf_counter()
        if synced:
            synchronize()
        done = time.perf_counter()
        if eager.count > before:
            rows.append(((returned - start) * 1e3, (done - start) * 1e3))
    return rows


def sync_sites(engine: LLMEngine, eager: EagerSteps, args, vocab: int) -> list[str]:
    """Where the host waits for the device in one eager step (the first one of a new burst that has
    decodes beside its chunks)."""
    seen: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        ours = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in stack[-6:]]
        seen.append(f"{str(message)[:80]} <- " + " <- ".join(reversed(ours)))

    add_burst(engine, "s", args.requests, args.context, vocab)
    steps = 0
    while engine.has_unfinished_requests():
        before = eager.count
        mixed = steps >= 1
        old = warnings.showwarning
        if mixed:
            synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record if mixed else old
            engine.step()
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
        steps += 1
        if mixed and eager.count > before:
            break
    while engine.has_unfinished_requests():
        engine.step()
    return seen


def linear_host_us(device: torch.device, rows: int, hidden: int, widths: list[int], repeats: int = 40) -> dict:
    """Host us per `F.linear` call at `rows` rows issued back to back, for each output width."""
    out = {}
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=device)
    for n in widths:
        w = torch.randn(n, hidden, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            F.linear(x, w)
        synchronize()
        start = time.perf_counter()
        for _ in range(repeats):
            F.linear(x, w)
        out[n] = (time.perf_counter() - start) / repeats * 1e6
        synchronize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hal", default="cuda")
    parser.add_argument("--model", default="ouro-1.4b", choices=sorted(p.stem for p in CONFIGS.glob("*.json")))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--narrow", action="store_true", help="the model at width 64 (a smoke test of this tool)")
    parser.add_argument("--eager", action="store_true", help="steps past the split caps run the eager pass, "
                        "not a packed captured pass (the default)")
    args = parser.parse_args()
    device_hal = hal.get(args.hal)
    device = device_hal.device()
    if args.narrow:
        from prefill_host_cost import narrow_model
        model = narrow_model(args.model, args.context + 64)
    else:
        model = zoo.from_config(CONFIGS / f"{args.model}.json", dtype="bfloat16", device=device, seed=0)
    vocab = model.config.vocab_size
    engine = LLMEngine(model, device_hal, EngineConfig(
        max_num_seqs=args.requests, max_model_len=args.context + 32, max_num_batched_tokens=args.budget))
    eager = EagerSteps(packed=not args.eager)
    add_burst(engine, "w", 4, args.context, vocab)         # compiles the eager paths' kernels
    burst(engine, eager, synced=False)

    add_burst(engine, "a", args.requests, args.context, vocab)
    start = time.perf_counter()
    burst(engine, eager, synced=False)
    print(f"{'eager' if args.eager else 'packed'} steps: burst as served: {(time.perf_counter() - start) * 1e3:.0f} ms for {args.requests} x {args.context} "
          f"(8 tokens each) at a budget of {args.budget}")
    add_burst(engine, "b", args.requests, args.context, vocab)
    rows = burst(engine, eager, synced=True)
    if not rows:
        raise SystemExit("no step ran the pass this measures (the CPU Hal captures nothing: packed steps need "
                         "graphs; use --eager there)")
    kind = "eager" if args.eager else "packed"
    host, whole = [r[0] for r in rows], [r[1] for r in rows]
    print(f"{kind} steps, each from an idle device: {len(rows)}; host (until step() returns) median "
          f"{statistics.median(host):.1f} ms (min {min(host):.1f}, max {max(host):.1f}); until the device is "
          f"done median {statistics.median(whole):.1f} ms (min {min(whole):.1f})")

    print(f"operations that wait for the device in one {kind} step with decodes beside its chunks:")
    sites = sync_sites(engine, eager, args, vocab) if torch.cuda.is_available() else []
    for site in sites[:40]:
        print("  ", site)
    print(f"   ({len(sites)} in all)")

    profiler = cProfile.Profile()
    add_burst(engine, "c", args.requests, args.context, vocab)
    rows = burst(engine, eager, synced=True, profiler=profiler)
    print(f"under cProfile: {len(rows)} {kind} steps, host median {statistics.median(r[0] for r in rows):.1f} ms")
    for key in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(args.top)
        print(f"--- by {key} (all steps of the burst, {kind} and not) ---")
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:12000])

    hidden = model.config.hidden_size
    rows_per_step = args.budget                 # the budget counts the decodes beside the chunks
    widths = sorted({p.shape[0] for n, p in model.named_parameters() if p.dim() == 2 and p.shape[1] == hidden})
    print(f"F.linear host us per call at {rows_per_step} rows x {hidden}: "
          + ", ".join(f"N={n}: {us:.1f}" for n, us in linear_host_us(device, rows_per_step, hidden, widths).items()))
    print("... at 64 rows: " + ", ".join(f"N={n}: {us:.1f}" for n, us in linear_host_us(device, 64, hidden, widths).items()))


if __name__ == "__main__":
    main()
