"""Every cuBLASLt algorithm its heuristic offers for the decode projections, timed against torch's
pick (docs/performance.md lever 99), and the table hal/cuda/blaslt_table.py holds.

Each candidate runs in a CUDA graph over enough weight copies that the weights come from HBM; the
time is per call (the graph's replay over the copies), the same way for torch's `F.linear`.

    python3 tools/lt_algo_probe.py --survey ouro64,nanbeige1 [--json rows.jsonl]
        every candidate of the four projections of a family at M rows, with kernel names
    python3 tools/lt_algo_probe.py --table [--families ouro,nanbeige,huginn] [--json rows.jsonl]
        the decode buckets' shapes (or `--rows 1024,8192`); prints the table entry (ranks that beat
        F.linear by >= 3% in two alternating re-timings) to paste into hal/cuda/blaslt_table.py
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hal.cuda.blaslt import COMPUTE_32F, CUDA_R_16BF, CUDA_R_32F, BlasLt  # noqa: E402
from runtime.execution.graphs import DEFAULT_BUCKETS  # noqa: E402

L2_BYTES = 50 << 20
MIN_GAIN = 1.03
SHAPES = {   # family -> [(projection, N, K)] of the fused decode matrices
    "ouro": [("qkv", 6144, 2048), ("o", 2048, 2048), ("gate_up", 11264, 2048), ("down", 2048, 5632)],
    "nanbeige": [("qkv", 8192, 3072), ("o", 3072, 6144), ("gate_up", 21504, 3072), ("down", 3072, 10752)],
    "huginn": [("qkv", 15840, 5280), ("o", 5280, 5280), ("gate_up", 35840, 5280), ("down", 5280, 17920)],
}


def time_graph(run_copies, replays: int = 15) -> float:
    """Microseconds per call (median replay): one graph holds a call per weight copy."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_copies()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls = run_copies()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})


class Shape:
    """One projection's weight copies (enough to pass through L2) and input, and its timers."""

    def __init__(self, lt: BlasLt, m: int, n: int, k: int) -> None:
        self.lt, self.m, self.n, self.k = lt, m, n, k
        copies = max(2, math.ceil(3 * L2_BYTES / (n * k * 2)))
        copies = 2 if m >= 1024 else copies          # long prompts: compute-bound, L2 does not matter
        self.ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        self.x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        self.ref = F.linear(self.x.float(), self.ws[0].float())
        self.num_candidates = len(lt.plan(m, n, k, torch.bfloat16).candidates)

    def choices(self, sm_targets: tuple[int, ...]) -> list[tuple[int, int]]:
        """(sm_target, rank) of every candidate the heuristic lists at each target (0: its default)."""
        return [(t, r) for t in sm_targets for r in range(len(self.lt.plan(self.m, self.n, self.k, torch.bfloat16,
                                                                               t).candidates))]

    def run(self, rank: int | tuple[int, int] | None):
        target, rank = rank if isinstance(rank, tuple) else (0, rank)
        for w in self.ws:
            F.linear(self.x, w) if rank is None else self.lt.linear(self.x, w, rank, target)
        return len(self.ws)

    def us(self, rank: int | tuple[int, int] | None) -> float:
        return time_graph(lambda: self.run(rank))

    def rel_err(self, rank: int | tuple[int, int]) -> float:
        target, rank = rank if isinstance(rank, tuple) else (0, rank)
        y = self.lt.linear(self.x, self.ws[0], rank, target).float()
        return ((y - self.ref).abs().max() / self.ref.abs().max()).item()


def survey(lt: BlasLt, family: str, m: int, emit) -> None:
    for proj, n, k in SHAPES[family]:
        s = Shape(lt, m, n, k)
        base = s.us(None)
        gb = n * k * 2 / 1e9
        emit(dict(family=family, m=m, proj=proj, n=n, k=k, algo="torch", us=round(base, 2), tbps=round(gb / base * 1e3, 3),
                  kernels=kernel_names(lambda: F.linear(s.x, s.ws[0]))))
        for rank in range(s.num_candidates):
            try:
                us = s.us(rank)
                row = dict(us=round(us, 2), tbps=round(gb / us * 1e3, 3), gain=round(base / us, 3),
                           rel_err=round(s.rel_err(rank), 5),
                           waves=round(lt.plan(m, n, k, torch.bfloat16).candidates[rank].waves, 3),
                           kernels=kernel_names(lambda: lt.linear(s.x, s.ws[0], rank)))
            except RuntimeError as exc:
                row = dict(error=str(exc)[:200])
            emit(dict(family=family, m=m, proj=proj, n=n, k=k, algo=rank, **row))


def table(lt: BlasLt, families: list[str], rows: list[int], emit,
          sm_targets: tuple[int, ...] = (0,)) -> dict[tuple[int, int, int], object]:
    """Choices that beat `F.linear` (whose kernel is usually the default list's first) by MIN_GAIN,
    confirmed twice: a rank of the default list, or (sm_target, rank)."""
    chosen: dict[tuple[int, int, int], object] = {}
    for family in families:
        for proj, n, k in SHAPES[family]:
            for m in rows:
                s = Shape(lt, m, n, k)
                base = s.us(None)
                times = {choice: s.us(choice) for choice in s.choices(sm_targets)}
                best = min(times, key=times.get)
                row = dict(family=family, proj=proj, m=m, n=n, k=k, torch=round(base, 2),
                           first=round(times[(0, 0)], 2), best=best, best_us=round(times[best], 2),
                           candidates=len(times))
                if base / times[best] >= MIN_GAIN:
                    again = [(s.us(None), s.us(best)) for _ in range(2)]     # alternating re-timings
                    row["again"] = [[round(a, 2), round(b, 2)] for a, b in again]
                    if all(a / b >= MIN_GAIN for a, b in again) and s.rel_err(best) < 2e-2:
                        chosen[(m, n, k)] = best[1] if best[0] == 0 else best
                        row["kept"] = True
                emit(row)
                del s
    return chosen


# ---- beyond the heuristic's first list: SM-count targets and the enumerated algorithms -------------
CAP_SPLITK, CAP_REDUCTION_MASK, CAP_TILE_IDS, CAP_STAGES_IDS = 0, 1, 6, 13
CONFIG_TILE, CONFIG_SPLITK, CONFIG_REDUCTION, CONFIG_STAGES = 1, 2, 3, 6
TYPES = (COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF)   # compute, scale, A-D


class Explorer:
    """ctypes calls the table does not need: every (algorithm id, tile, stages, split-K) combination
    `cublasLtMatmulAlgoCheck` accepts (H200, cuBLASLt 13.1: all far slower than the heuristic's)."""

    def __init__(self, lt: BlasLt) -> None:
        import ctypes
        self.ct, self.lt, lib = ctypes, lt, lt.lib
        vp, i32, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        for fn, args in {"cublasLtMatmulAlgoGetIds": [vp, i32, i32, i32, i32, i32, i32, i32, vp, vp],
                         "cublasLtMatmulAlgoInit": [vp, i32, i32, i32, i32, i32, i32, i32, vp],
                         "cublasLtMatmulAlgoCapGetAttribute": [vp, i32, vp, sz, vp],
                         "cublasLtMatmulAlgoConfigSetAttribute": [vp, i32, vp, sz],
                         "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, vp, vp]}.items():
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = i32

    def _cap_array(self, algo, attr: int) -> list[int]:
        ct = self.ct
        written = ct.c_size_t(0)
        self.lt.lib.cublasLtMatmulAlgoCapGetAttribute(ct.byref(algo), attr, None, 0, ct.byref(written))
        count = written.value // 4
        if count == 0:
            return []
        buf = (ct.c_uint32 * count)()
        self.lt.lib.cublasLtMatmulAlgoCapGetAttribute(ct.byref(algo), attr, buf, 4 * count, ct.byref(written))
        return list(buf)

    def _cap_int(self, algo, attr: int) -> int:
        ct = self.ct
        v, written = ct.c_uint32(0), ct.c_size_t(0)
        self.lt.lib.cublasLtMatmulAlgoCapGetAttribute(ct.byref(algo), attr, ct.byref(v), 4, ct.byref(written))
        return v.value

    def enumerated(self, m: int, n: int, k: int, limit: int = 400):
        """[(label, HeuristicResult-like algo, workspace)] for the combinations AlgoCheck accepts."""
        from hal.cuda.blaslt import HeuristicResult
        ct, lt = self.ct, self.lt
        plan = lt.plan(m, n, k, torch.bfloat16)
        ids, count = (ct.c_int * 256)(), ct.c_int(0)
        lt.lib.cublasLtMatmulAlgoGetIds(lt.handle, *TYPES, 256, ids, ct.byref(count))
        out = []
        a, b, c = plan.layouts
        for algo_id in list(ids)[:count.value]:
            base = HeuristicResult()
            if lt.lib.cublasLtMatmulAlgoInit(lt.handle, *TYPES, algo_id, ct.byref(base.algo)) != 0:
                continue
            tiles = self._cap_array(base.algo, CAP_TILE_IDS) or [0]
            stages = self._cap_array(base.algo, CAP_STAGES_IDS) or [0]
            splits = [1, 2, 3, 4, 6, 8] if self._cap_int(base.algo, CAP_SPLITK) else [1]
            mask = self._cap_int(base.algo, CAP_REDUCTION_MASK)
            scheme = next((bit for bit in (1, 2, 4) if mask & bit), 0)
            for tile in tiles:
                for stage in stages:
                    for split in splits:
                        r = HeuristicResult()
                        ct.memmove(ct.byref(r.algo), ct.byref(base.algo), ct.sizeof(r.algo))
                        for attr, value in ((CONFIG_TILE, tile), (CONFIG_STAGES, stage), (CONFIG_SPLITK, split),
                                            (CONFIG_REDUCTION, scheme if split > 1 else 0)):
                            v = ct.c_uint32(value)
                            lt.lib.cublasLtMatmulAlgoConfigSetAttribute(ct.byref(r.algo), attr, ct.byref(v), 4)
                        check = HeuristicResult()
                        if lt.lib.cublasLtMatmulAlgoCheck(lt.handle, plan.desc, a, b, c, c, ct.byref(r.algo),
                                                          ct.byref(check)) != 0:
                            continue
                        r.workspace = check.workspace
                        if r.workspace > (32 << 20):
                            continue
                        out.append((f"id{algo_id}/t{tile}/s{stage}/k{split}", r))
        return out[:limit] if len(out) <= limit else out[::max(1, len(out) // limit)][:limit]


def explore(lt: BlasLt, family: str, m: int, emit) -> None:
    ex = Explorer(lt)
    for proj, n, k in SHAPES[family]:
        s = Shape(lt, m, n, k)
        base = s.us(None)
        emit(dict(family=family, m=m, proj=proj, what="torch", us=round(base, 2)))
        best = ("torch", base)

        def timed(label, plan, result):
            nonlocal best
            def run():
                for w in s.ws:
                    lt.matmul(s.x, w, plan, result)
                return len(s.ws)
            try:
                us = time_graph(run, replays=7)
            except RuntimeError:
                torch.cuda.synchronize()
                return None
            if us < best[1]:
                best = (label, us)
            return us

        for target in (128, 120, 112, 100, 96, 88, 80, 66, 44):
            plan = lt.plan(m, n, k, torch.bfloat16, target)
            times = [timed(f"sm{target}/r{rank}", plan, r) for rank, r in enumerate(plan.candidates)]
            emit(dict(family=family, m=m, proj=proj, what=f"sm_target {target}",
                      us=[None if t is None else round(t, 2) for t in times]))
        combos = ex.enumerated(m, n, k)
        plan = lt.plan(m, n, k, torch.bfloat16)
        enumerated = sorted(((timed(label, plan, r), label) for label, r in combos), key=lambda t: (t[0] is None, t[0]))
        emit(dict(family=family, m=m, proj=proj, what="enumerated", count=len(combos),
                  best=[(round(t, 2), label) for t, label in enumerated[:6] if t is not None]))
        emit(dict(family=family, m=m, proj=proj, what="best", label=best[0], us=round(best[1], 2),
                  gain=round(base / best[1], 3)))
        del s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--survey", default=None, help="family+rows, comma separated: ouro64,nanbeige1")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--explore", default=None, help="family+rows: SM-count targets and enumerated algorithms")
    ap.add_argument("--families", default="ouro,nanbeige,huginn")
    ap.add_argument("--max-rows", type=int, default=256)
    ap.add_argument("--sm-targets", default="0", help="SM-count targets whose lists the table searches: 0,88,66")
    ap.add_argument("--rows", default=None, help="row counts to tune instead of the decode buckets: 1024,8192")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sink = open(args.json, "a") if args.json else None

    def emit(row: dict) -> None:
        if sink:
            sink.write(json.dumps(row) + "\n")
            sink.flush()
        short = {key: value for key, value in row.items() if key not in ("kernels", "n", "k")}
        print(json.dumps(short), (row.get("kernels") or [""])[0][:60], flush=True)

    lt = BlasLt()
    props = torch.cuda.get_device_properties(0)
    print(f"# {props.name}, {props.multi_processor_count} SMs, cuBLASLt {lt.version}", flush=True)
    for spec in (args.survey.split(",") if args.survey else []):
        family = spec.rstrip("0123456789")
        survey(lt, family, int(spec[len(family):]), emit)
    for spec in (args.explore.split(",") if args.explore else []):
        family = spec.rstrip("0123456789")
        explore(lt, family, int(spec[len(family):]), emit)
    if args.table:
        rows = ([int(r) for r in args.rows.split(",")] if args.rows
                else [b for b in DEFAULT_BUCKETS if b <= args.max_rows])
        ranks = table(lt, args.families.split(","), rows, emit, tuple(int(t) for t in args.sm_targets.split(",")))
        key = (props.name, props.multi_processor_count, lt.version, "bfloat16")
        print("TABLE", repr(key), ":", repr(dict(sorted(ranks.items()))), flush=True)


if __name__ == "__main__":
    main()
