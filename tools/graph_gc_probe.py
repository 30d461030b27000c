"""Does a cycle collection inside a CUDA graph capture break it? One process per case: a dead
reference cycle holding nothing, tensors, captured graphs, or both, then a capture inside which every
allocation collects (`gc.set_threshold(1, 1, 1)`), raw or under `cycle_collector_paused`
(hal/common/graph.py). docs/benchmarks.md, forty-second session: on an H100 the cases whose cycle
holds a graph failed ("operation failed due to a previous error during capture") unless paused.

    python3 tools/graph_gc_probe.py            # every case, one line each
    python3 tools/graph_gc_probe.py graph-20-raw
"""
import gc
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = ("none-0-raw", "tensor-4-raw", "graph-1-raw", "graph-20-raw", "both-10-raw", "graph-20-paused",
         "both-10-paused")


class Cycle:
    def __init__(self) -> None:
        self.me = self              # only the cycle collector frees it
        self.kept: list = []


def make_dead_cycle(kind: str, count: int) -> None:
    holder = Cycle()
    for _ in range(count):
        if kind in ("graph", "both"):
            graph, x, stream = torch.cuda.CUDAGraph(), torch.randn(256, 256, device="cuda"), torch.cuda.Stream()
            with torch.cuda.stream(stream):
                x @ x                                   # warm-up outside capture
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                y = x @ x
            holder.kept.append((graph, x, y))
        if kind in ("tensor", "both"):
            holder.kept.append(torch.randn(64 << 20, device="cuda"))      # 256 MiB
    torch.cuda.synchronize()


def run(case: str) -> str:
    from hal.common.graph import cycle_collector_paused

    kind, count, mode = case.split("-")
    a, stream = torch.randn(1024, 1024, device="cuda"), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        a @ a
    torch.cuda.synchronize()
    gc.collect()
    make_dead_cycle(kind, int(count))
    graph, thresholds = torch.cuda.CUDAGraph(), gc.get_threshold()
    try:
        with cycle_collector_paused() if mode == "paused" else torch.no_grad():
            with torch.cuda.graph(graph, stream=stream):
                gc.set_threshold(1, 1, 1)               # every allocation collects, unless paused
                junk = [{"row": i} for i in range(1000)]
                c = (a @ a) @ a
                gc.set_threshold(*thresholds)
        graph.replay()
        torch.cuda.synchronize()
        right = torch.allclose(c, (a @ a) @ a, rtol=1e-3, atol=1e-2)
        return f"{case}: capture ok, replay {'right' if right else 'WRONG'} ({len(junk)} objects made inside)"
    except Exception as exc:                            # the capture's own error is the result
        return f"{case}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        gc.set_threshold(*thresholds)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(run(sys.argv[1]), flush=True)
    else:
        for case in CASES:
            done = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, timeout=180)
            lines = (done.stdout.strip() or done.stderr.strip()).splitlines()
            print(lines[-1] if lines else f"{case}: no output (rc {done.returncode})", flush=True)
