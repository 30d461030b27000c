"""Host cost of a speculation round against a plain decode step, measured on the CPU.

    python tools/spec_host_cost.py [--new 64] [--draft-loops 1 2 3] [--dtype float32] [--per-pass]

On the CPU a "graph" replay (hal/common/graph.py) runs the captured work eagerly, so the time
inside replays stands for device work and the rest of a step is host work: building inputs and
metadata, staging, bookkeeping, and every torch op issued outside a replay (on a GPU each of those
is a kernel launch or a copy the host issues one by one). Per decode step (speculation off) or per
round (on), batch 1, greedy, the packaged ouro-tiny: median wall ms, ms inside replays, host ms
(wall - replays), replays, and torch ops outside replays (counted in a second, slower run).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hal.common import graph as graph_module
from runtime import LLM, SamplingParams
from runtime.config import EngineConfig, SpeculativeConfig

PROMPT = "And God said unto Moses"


class Probe:
    """Times replays and (optionally) counts torch ops issued outside them."""

    def __init__(self) -> None:
        self.replay_s = 0.0
        self.replays = 0
        self.depth = 0
        self.ops_outside = 0

    def install(self) -> None:
        original = graph_module.EagerGraph.replay
        probe = self

        def replay(graph) -> None:
            start = time.perf_counter()
            probe.depth += 1
            try:
                original(graph)
            finally:
                probe.depth -= 1
                probe.replay_s += time.perf_counter() - start
                probe.replays += 1
        graph_module.EagerGraph.replay = replay


class CountOps(TorchDispatchMode):
    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.probe.depth == 0 and func not in (torch.ops.aten.detach.default,):
            self.probe.ops_outside += 1
        return func(*args, **(kwargs or {}))


def measure(llm: LLM, new: int, probe: Probe, count: bool) -> dict:
    engine = llm.engine
    rows = []
    original = engine.step

    def step():
        r0, n0, o0 = probe.replay_s, probe.replays, probe.ops_outside
        start = time.perf_counter()
        out = original()
        wall = time.perf_counter() - start
        rows.append((wall, probe.replay_s - r0, probe.replays - n0, probe.ops_outside - o0))
        return out
    engine.step = step
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))     # warm-up, captures
    rows.clear()
    if count:
        with CountOps(probe):
            out = llm.generate(PROMPT, params)[0]
    else:
        out = llm.generate(PROMPT, params)[0]
    engine.step = original
    steps = rows[1:-1]                   # decode steps / rounds (not the prefill, not a short last round)
    med = lambda i: statistics.median(r[i] for r in steps)      # noqa: E731
    return {"steps": len(rows) - 1, "wall_ms": med(0) * 1e3, "replay_ms": med(1) * 1e3,
            "host_ms": statistics.median((r[0] - r[1]) for r in steps) * 1e3, "replays": med(2),
            "ops_outside": med(3), "tokens": list(out.token_ids),
            "acceptance": (out.metrics.num_accepted_tokens / out.metrics.num_draft_tokens
                           if out.metrics.num_draft_tokens else float("nan"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ouro-tiny")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--num-tokens", type=int, default=4)
    parser.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--per-pass", action="store_true", help="also each depth's rounds pass by pass (fuse_round=false)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    probe = Probe()
    probe.install()
    configs = [("off", SpeculativeConfig())]
    for d in args.draft_loops:
        configs.append((f"K={args.num_tokens} d={d}", SpeculativeConfig(args.num_tokens, d)))
        if args.per_pass:
            configs.append((f"  per-pass", SpeculativeConfig(args.num_tokens, d, fuse_round=False)))
    base = None
    print(f"{'':12} {'steps':>5} {'wall ms':>8} {'replay ms':>9} {'host ms':>8} {'replays':>7} "
          f"{'ops outside':>11} {'accept':>6}  tokens")
    for name, spec in configs:
        llm = LLM(args.model, hal="cpu", dtype=args.dtype, engine_config=EngineConfig(num_kv_blocks=64, speculative=spec))
        timed = measure(llm, args.new, probe, count=False)
        counted = measure(llm, args.new, probe, count=True)
        base = base or timed["tokens"]
        print(f"{name:12} {timed['steps']:5d} {timed['wall_ms']:8.2f} {timed['replay_ms']:9.2f} {timed['host_ms']:8.2f} "
              f"{timed['replays']:7.0f} {counted['ops_outside']:11.0f} {timed['acceptance']:6.2f}  "
              f"{'equal' if timed['tokens'] == base else 'DIFFER'}")


if __name__ == "__main__":
    main()
