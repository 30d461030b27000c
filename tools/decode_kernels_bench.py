"""The decode kernels of issue 19 on the GPU, against cuBLAS and the bandwidth floor, at the
Ouro-1.4B shapes (hidden 2048, q|k|v 6144, o 2048, gate|up 11264, down 2048 x 5632, lm_head 49152)
for M = 1, 2, 4, 8 rows, bf16:

    PYTHONPATH=. python tools/decode_kernels_bench.py [--budget 90] [--out rows.jsonl]

Cells, most important first (the budget stops the run between cells; what was left is listed):
  1. every projection: cuBLAS (`F.linear`) vs `gemv` in the Hal's sm_90 configs
  2. the fused projections against the chains they replace (RMSNorm -> q|k|v; Ouro's sandwich
     norms -> gate|up; SwiGLU -> down + residual; o + residual)
  3. rotary + KV write in one launch vs two, T = 1..8
  4. prompts without context, 1K-8K tokens: the paged Triton kernel over their own K/V vs torch's varlen
     flash and cuDNN (one layer-plane)
  5. config sweeps of `gemv_m1` (one row) and `gemv` (2..8 rows) on o, gate|up and down
  6. (`--groups wide`) the gemv kernel at 64 and 128 rows against cuBLAS, a config sweep
Each cell replays a CUDA graph of calls over enough distinct weight copies that they do not sit in
the 60 MB L2 (median of 10 replays), checks the first call against the fp32 product, and prints
us per call, TB/s, the floor (bytes / 4.27 TB/s) and floor / time. A failing cell prints its error
and the run goes on. The table at the end: per shape and M, cuBLAS, gemv (default), the best sweep
config, the floor; and the batch-1 step estimate (96 layer-loops + lm_head).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hal.kernels.configs import KernelConfig, configs_for

HEADS, KV_HEADS, HEAD_DIM = 16, 16, 128
SHAPES = {"qkv": (3 * 2048, 2048), "o": (2048, 2048), "gate_up": (2 * 5632, 2048), "down": (2048, 5632),
          "lm_head": (49152, 2048)}                                       # (N, K) of the weight
ROWS = (1, 2, 4, 8)
FLOOR_BANDWIDTH = 4.27e12            # bytes/s: the device-to-device copy rate of this H200 (docs/benchmarks.md)
L2_BYTES = 60 * 2 ** 20
LAYER_LOOPS = 96                     # 24 layers x 4 loops per Ouro-1.4B decode step
M1_SWEEP = [KernelConfig(1, bn, w, s, block_k=bk, split_k=sk) for bn, w, s, bk, sk in (
    (16, 4, 1, 512, 0), (16, 4, 2, 512, 0), (32, 4, 2, 256, 0), (8, 4, 2, 512, 0), (16, 8, 2, 512, 0),
    (16, 4, 2, 256, 1), (16, 4, 2, 256, 4), (16, 4, 2, 128, 0))] + [KernelConfig(16, 32, 4, 4, block_k=256, split_k=0)]
ROWS_SWEEP = [KernelConfig(16, bn, w, s, block_k=bk, split_k=sk) for bn, w, s, bk, sk in (
    (16, 4, 4, 256, 0), (64, 4, 3, 128, 0), (32, 4, 3, 512, 0), (32, 8, 4, 256, 0), (32, 4, 4, 256, 1),
    (32, 4, 4, 256, 4), (32, 4, 2, 256, 0))]
SWEEP_SHAPES = ("o", "gate_up", "down")
PREFILL_CASES = ("1024", "1536", "2048", "3072", "4096", "8192", "8x1024")   # prompt tokens, "NxT"


@dataclass
class Row:
    group: str
    shape: str
    rows: int
    variant: str
    us: float | None = None
    floor_us: float | None = None
    tbps: float | None = None
    err: float | None = None
    note: str = ""

    def line(self) -> str:
        if self.us is None:
            return f"{self.group:8} {self.shape:10} {self.rows:>3} {self.variant:34} {'-':>8}  {self.note}"
        ratio = f"{self.floor_us / self.us:6.0%}" if self.floor_us else "     -"
        err = f"{self.err:.1e}" if self.err is not None else "-"
        return (f"{self.group:8} {self.shape:10} {self.rows:>3} {self.variant:34} {self.us:8.2f} "
                f"{(self.tbps or 0):6.2f} {(self.floor_us or 0):8.2f} {ratio} {err:>8}  {self.note}")


HEADER = (f"{'group':8} {'shape':10} {'M':>3} {'variant':34} {'us/call':>8} {'TB/s':>6} {'floor us':>8} "
          f"{'fl/t':>6} {'rel err':>8}  note")


def time_calls(calls: list[Callable[[], object]], replays: int = 10) -> tuple[float, str]:
    """Median us per call of a CUDA graph replaying `calls` once each (eager timing if capture fails)."""
    for call in calls:                       # compile, allocate, fill lazy caches outside the capture
        call()
    torch.cuda.synchronize()
    how = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for call in calls:
                call()
        run = graph.replay
    except Exception as exc:                 # a call that cannot be captured is still timed
        how = f"eager ({type(exc).__name__})"

        def run() -> None:
            for call in calls:
                call()
    run()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times), how


@dataclass
class Bench:
    device: torch.device
    deadline: float
    print_fn: Callable[[str], None] = print
    device_units: int = 4                    # SMs: the gemv plans split K for them
    rows: list[Row] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def over(self) -> bool:
        return time.monotonic() > self.deadline

    def cell(self, group: str, shape: str, num_rows: int, variant: str, calls: Callable[[], list],
             num_bytes: float, check: Callable[[], float] | None = None) -> Row:
        row = Row(group, shape, num_rows, variant)
        if self.over():
            self.skipped.append(f"{group}/{shape}/M{num_rows}/{variant}")
            return row
        try:
            fns = calls()
            row.err = check() if check is not None else None
            row.us, how = time_calls(fns)
            row.floor_us = num_bytes / FLOOR_BANDWIDTH * 1e6
            row.tbps = num_bytes / row.us / 1e6
            row.note = "" if how == "graph" else how
        except Exception as exc:              # one failing config must not end the run
            row.note = f"ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
        self.rows.append(row)
        self.print_fn(row.line())
        return row


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


class Weights:
    """Distinct copies of one bf16 weight, enough that a graph of calls streams them from HBM."""

    def __init__(self, n: int, k: int, device: torch.device) -> None:
        self.bytes = n * k * 2
        copies = max(1, min(48, math.ceil(4 * L2_BYTES / self.bytes)))
        self.copies = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]


def _randn(*shape: int, device: torch.device) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=torch.bfloat16)


def _linear_cells(bench: Bench, group: str, rows: tuple[int, ...], variants) -> None:
    """One cell per projection, row count and variant `(label, fn(x, weight), checked)`, over weight
    copies that stream from HBM; checked variants are compared with the fp32 product."""
    for name, (n, k) in SHAPES.items():
        w = Weights(n, k, bench.device)
        for m in rows:
            xs = [_randn(m, k, device=bench.device) for _ in w.copies]
            num_bytes = w.bytes + 2 * m * (k + n)
            for label, fn, checked in variants:
                check = (lambda fn=fn, x=xs[0], wt=w.copies[0]: _rel_err(fn(x, wt), x.float() @ wt.float().T)
                         if checked else None)
                bench.cell(group, name, m, label, lambda fn=fn, xs=xs: [
                    lambda x=x, wt=wt: fn(x, wt) for x, wt in zip(xs, w.copies)], num_bytes, check)
        del w


def projection_cells(bench: Bench, ops, configs) -> None:
    """1. cuBLAS vs gemv for every projection and row count."""
    import torch.nn.functional as F

    _linear_cells(bench, "proj", ROWS, [("cublas F.linear", F.linear, False),
                                        ("gemv (default config)", ops.linear, True)])


WIDE_ROWS = (64, 128)
WIDE_SWEEP = [KernelConfig(16, bn, w, s, block_k=bk, split_k=0) for bn, bk, w, s in (
    (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 4, 3), (128, 128, 8, 3))]


def wide_cells(bench: Bench, ops, configs) -> None:
    """6. The gemv kernel at the rows of batch-64 and batch-128 decode against cuBLAS (plain products;
    the ops route at most gemv_ops.MAX_ROWS rows to the kernel, so the cells call it directly)."""
    import torch.nn.functional as F

    from hal.kernels.gemv import NONE
    from hal.kernels.gemv_ops import Gemv

    def direct(config):
        wide = Gemv({**configs, "gemv": config}, bench.device_units)
        return lambda x, wt: wide._run(x, wt, NONE)

    _linear_cells(bench, "wide", WIDE_ROWS, [("cublas F.linear", F.linear, False)] + [
        (f"gemv n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}", direct(c), True) for c in WIDE_SWEEP])


def fused_cells(bench: Bench, ops, configs) -> None:
    """2. Fused projections against the chains of launches they replace."""
    import torch.nn.functional as F

    from hal.kernels.ops import rms_norm, silu_and_mul

    dev = bench.device
    hidden = SHAPES["o"][1]
    for m in ROWS:
        norm_w, post_w = _randn(hidden, device=dev), _randn(hidden, device=dev)
        # q|k|v after the input norm (Nanbeige, Huginn prelude, and Ouro's first layer of a loop)
        w = Weights(*SHAPES["qkv"], dev)
        xs = [_randn(m, hidden, device=dev) for _ in w.copies]
        nb = w.bytes + 2 * m * (hidden + SHAPES["qkv"][0])
        bench.cell("fused", "qkv", m, "rms_norm -> cublas", lambda: [
            lambda x=x, wt=wt: F.linear(rms_norm(x, norm_w, 1e-6, None, configs), wt) for x, wt in zip(xs, w.copies)], nb)
        bench.cell("fused", "qkv", m, "rms_norm -> gemv", lambda: [
            lambda x=x, wt=wt: ops.linear(rms_norm(x, norm_w, 1e-6, None, configs), wt) for x, wt in zip(xs, w.copies)],
            nb)
        bench.cell("fused", "qkv", m, "rms_norm_linear (prologue)", lambda: [
            lambda x=x, wt=wt: ops.rms_norm_linear(x, norm_w, 1e-6, wt) for x, wt in zip(xs, w.copies)], nb,
            lambda: _rel_err(ops.rms_norm_linear(xs[0], norm_w, 1e-6, w.copies[0]),
                             rms_norm(xs[0], norm_w, 1e-6, None, configs).float() @ w.copies[0].float().T))
        del w
        # gate|up after Ouro's sandwich: h = r + norm(o_out); norm(h) -> gate|up
        w = Weights(*SHAPES["gate_up"], dev)
        xs = [_randn(m, hidden, device=dev) for _ in w.copies]
        res = [_randn(m, hidden, device=dev) for _ in w.copies]
        nb = w.bytes + 2 * m * (3 * hidden + SHAPES["gate_up"][0])

        def chain(x, r, wt, lin):
            h = rms_norm(x, post_w, 1e-6, r, configs)
            return lin(rms_norm(h, norm_w, 1e-6, None, configs), wt), h

        bench.cell("fused", "gate_up", m, "2x rms_norm -> cublas", lambda: [
            lambda x=x, r=r, wt=wt: chain(x, r, wt, F.linear) for x, r, wt in zip(xs, res, w.copies)], nb)
        bench.cell("fused", "gate_up", m, "rms_norm(+res) -> rms_norm_linear", lambda: [
            lambda x=x, r=r, wt=wt: ops.rms_norm_linear(rms_norm(x, post_w, 1e-6, r, configs), norm_w, 1e-6, wt)
            for x, r, wt in zip(xs, res, w.copies)], nb)
        bench.cell("fused", "gate_up", m, "norm_residual_linear (prologue)", lambda: [
            lambda x=x, r=r, wt=wt: ops.norm_residual_linear(x, r, post_w, norm_w, 1e-6, wt)
            for x, r, wt in zip(xs, res, w.copies)], nb,
            lambda: _rel_err(ops.norm_residual_linear(xs[0], res[0], post_w, norm_w, 1e-6, w.copies[0])[0],
                             chain(xs[0], res[0], w.copies[0], lambda a, b: a.float() @ b.float().T)[0]))
        del w
        # down after SwiGLU, with the residual add (Nanbeige / Llama)
        w = Weights(*SHAPES["down"], dev)
        inter = SHAPES["down"][1]
        xs = [_randn(m, 2 * inter, device=dev) for _ in w.copies]
        res = [_randn(m, hidden, device=dev) for _ in w.copies]
        nb = w.bytes + 2 * m * (2 * inter + 2 * hidden)
        bench.cell("fused", "down", m, "silu_and_mul -> cublas -> add", lambda: [
            lambda x=x, r=r, wt=wt: r + F.linear(silu_and_mul(x, configs), wt) for x, r, wt in zip(xs, res, w.copies)],
            nb)
        bench.cell("fused", "down", m, "silu_mul_linear (+res)", lambda: [
            lambda x=x, r=r, wt=wt: ops.silu_mul_linear(x, wt, r) for x, r, wt in zip(xs, res, w.copies)], nb,
            lambda: _rel_err(ops.silu_mul_linear(xs[0], w.copies[0], res[0]),
                             res[0].float() + silu_and_mul(xs[0], configs).float() @ w.copies[0].float().T))
        del w
        # o with the residual add (Nanbeige / Llama)
        w = Weights(*SHAPES["o"], dev)
        xs = [_randn(m, hidden, device=dev) for _ in w.copies]
        res = [_randn(m, hidden, device=dev) for _ in w.copies]
        nb = w.bytes + 2 * m * 3 * hidden
        bench.cell("fused", "o", m, "cublas -> add", lambda: [
            lambda x=x, r=r, wt=wt: r + F.linear(x, wt) for x, r, wt in zip(xs, res, w.copies)], nb)
        bench.cell("fused", "o", m, "linear(+res)", lambda: [
            lambda x=x, r=r, wt=wt: ops.linear(x, wt, r) for x, r, wt in zip(xs, res, w.copies)], nb)
        del w


def rotary_cells(bench: Bench, configs) -> None:
    """3. Rotary and the KV write: two launches vs one (bytes are a few KiB: the time is the launch)."""
    from hal.kernels.kv_write import write_kv
    from hal.kernels.ops import rotary
    from hal.kernels.rotary_kv import rotary_kv_write

    dev = bench.device
    cache = torch.zeros(2, 64, 16, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    for t in ROWS:
        qkv = [_randn(t, HEADS + 2 * KV_HEADS, HEAD_DIM, device=dev) for _ in range(32)]
        pos = torch.randint(0, 1000, (t,), device=dev)
        slots = torch.randperm(64 * 16, device=dev)[:t]
        nb = 2 * t * (HEADS + 2 * KV_HEADS) * HEAD_DIM * 2

        def split(a):
            return a[:, :HEADS], a[:, HEADS:HEADS + KV_HEADS], a[:, HEADS + KV_HEADS:]

        def two(a):
            q, k, v = split(a)
            q, k = rotary(q, k, pos, 1e6, False, configs)
            write_kv(k, v, cache, slots, configs["kv_write"])
            return q

        bench.cell("rope+kv", "T", t, "rotary -> kv_write", lambda: [lambda a=a: two(a) for a in qkv], nb)
        bench.cell("rope+kv", "T", t, "rotary_kv_write", lambda: [
            lambda a=a: rotary_kv_write(*split(a), pos, 1e6, False, cache, slots, configs["rotary"]) for a in qkv], nb)


def _prefill_lens(case: str) -> list[int]:
    """"2048" -> [2048]; "8x1024" -> eight prompts of 1,024 tokens."""
    count, _, tokens = case.rpartition("x")
    return [int(tokens)] * int(count or 1)


def prefill_cells(bench: Bench, configs) -> None:
    """4. One layer-plane of prompts without context (`PREFILL_CASES`): the paged Triton kernel over their
    own K/V against the fresh path's varlen flash and cuDNN (one prompt, as many KV heads as heads), each
    with its cache write. Where they cross sets `hal.kernels.fresh.MIN_TOKENS`."""
    from hal.attention import PagedBatch
    from hal.kernels import fresh
    from hal.kernels.backend import TritonPagedAttention

    dev, page = bench.device, 16
    labels = {None: "own K/V paged (write+attend)", "flash": "fresh: varlen flash (write+attend)",
              "cudnn": "fresh: cudnn (write+attend)"}
    for case in PREFILL_CASES:
        lens = _prefill_lens(case)
        tables, num_blocks = [], 0
        for n in lens:
            tables.append(list(range(num_blocks, num_blocks + -(-n // page))))
            num_blocks += len(tables[-1])
        batch, tokens = PagedBatch(lens, lens, [tables], page), sum(lens)
        q = _randn(tokens, HEADS, HEAD_DIM, device=dev)
        k, v = _randn(tokens, KV_HEADS, HEAD_DIM, device=dev), _randn(tokens, KV_HEADS, HEAD_DIM, device=dev)
        flops = sum(4 * HEADS * HEAD_DIM * n * (n + 1) / 2 for n in lens)
        outs = {}
        for mode in (None, "flash", "cudnn"):
            if mode == "cudnn" and (len(lens) > 1 or HEADS != KV_HEADS):
                continue                    # cuDNN takes one prompt of MHA heads; others run flash
            backend = TritonPagedAttention(HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16, dev, page,
                                           configs=configs, fresh_attention=mode, fresh_min_tokens=0)
            cache = torch.zeros(backend.kv_cache_shape(num_blocks), device=dev, dtype=torch.bfloat16)
            meta = backend.build_meta(batch)

            def one(backend=backend, cache=cache, meta=meta, mode=mode):
                outs[mode] = backend.attend(q, k, v, cache, meta, 0, HEAD_DIM ** -0.5)
                return outs[mode]

            shortest, fresh.CUDNN_MIN_TOKENS = fresh.CUDNN_MIN_TOKENS, 1     # cuDNN at every length here
            try:
                row = bench.cell("prefill", f"{case} tok", 1, labels[mode], lambda one=one: [one], 0.0)
            finally:
                fresh.CUDNN_MIN_TOKENS = shortest
            if row.us:
                row.note = (row.note + f" {flops / row.us / 1e6:.0f} TFLOP/s").strip()
        for mode in ("flash", "cudnn"):
            if None in outs and mode in outs:
                bench.print_fn(f"# prefill {case}: {mode} vs own K/V paged, output rel err "
                               f"{_rel_err(outs[mode], outs[None]):.1e}")


def sweep_cells(bench: Bench, base: dict[str, KernelConfig]) -> None:
    """5. Launch configs of gemv_m1 (M = 1) and gemv (M = 8, then 2 and 4) on the plain projections,
    and of gemv_m1 on gate|up with Ouro's sandwich prologue (its L2 re-reads shrink with wider blocks)."""
    from hal.kernels.gemv_ops import Gemv

    def label(config: KernelConfig) -> str:
        return (f"{'fma' if config.block_m == 1 else 'dot'} n{config.block_n} k{config.block_k} "
                f"w{config.num_warps} s{config.num_stages} sk{config.split_k}")

    order = [(1, M1_SWEEP)] + [(m, ROWS_SWEEP) for m in sorted(ROWS, key=lambda m: (m != max(ROWS), m)) if m > 1]
    for m, sweep in order:
        for name in SWEEP_SHAPES:
            n, k = SHAPES[name]
            w = Weights(n, k, bench.device)
            xs = [_randn(m, k, device=bench.device) for _ in w.copies]
            for config in sweep:
                ops = Gemv({**base, "gemv_m1": config, "gemv": config}, bench.device_units)
                bench.cell("sweep", name, m, label(config), lambda ops=ops, xs=xs: [
                    lambda x=x, wt=wt: ops.linear(x, wt) for x, wt in zip(xs, w.copies)], w.bytes + 2 * m * (n + k),
                    lambda ops=ops, xs=xs: _rel_err(ops.linear(xs[0], w.copies[0]), xs[0].float() @ w.copies[0].float().T))
            del w
        if m == 1 and "gate_up" in SHAPES:
            n, k = SHAPES["gate_up"]
            w = Weights(n, k, bench.device)
            xs = [_randn(1, k, device=bench.device) for _ in w.copies]
            res = [_randn(1, k, device=bench.device) for _ in w.copies]
            post_w, norm_w = _randn(k, device=bench.device), _randn(k, device=bench.device)
            for config in sweep:
                ops = Gemv({**base, "gemv_m1": config, "gemv": config}, bench.device_units)
                bench.cell("sweep", "gate_up+nrl", 1, label(config), lambda ops=ops: [
                    lambda x=x, r=r, wt=wt: ops.norm_residual_linear(x, r, post_w, norm_w, 1e-6, wt)
                    for x, r, wt in zip(xs, res, w.copies)], w.bytes + 2 * (3 * k + n))
            del w


def summary(bench: Bench) -> list[str]:
    """Per shape and M: cuBLAS, gemv default, best of the sweep; and the batch-1 step estimate."""
    def us(group, shape, m, variant=None, best=False):
        found = [r for r in bench.rows if r.group == group and r.shape == shape and r.rows == m and r.us
                 and (variant is None or r.variant == variant)]
        if not found:
            return None, ""
        r = min(found, key=lambda r: r.us) if best else found[0]
        return r.us, r.variant

    lines = ["", "# summary: us per call (floor = weight bytes / 4.27 TB/s)",
             f"{'shape':8} {'M':>2} {'cublas':>8} {'gemv':>8} {'best':>8} {'floor':>8} {'gemv/fl':>7}  best config"]
    step = {"cublas": 0.0, "gemv": 0.0, "floor": 0.0}
    for name, (n, k) in SHAPES.items():
        for m in ROWS:
            cub, _ = us("proj", name, m, "cublas F.linear")
            gem, _ = us("proj", name, m, "gemv (default config)")
            best, label = us("sweep", name, m, best=True)
            floor = (n * k * 2 + 2 * m * (n + k)) / FLOOR_BANDWIDTH * 1e6
            fmt = lambda v: f"{v:8.2f}" if v else f"{'-':>8}"
            ratio = f"{floor / gem:7.0%}" if gem else f"{'-':>7}"
            lines.append(f"{name:8} {m:>2} {fmt(cub)} {fmt(gem)} {fmt(best)} {floor:8.2f} {ratio}  {label}")
            if m == 1:
                times = LAYER_LOOPS if name != "lm_head" else 1
                step["cublas"] += (cub or math.nan) * times
                step["gemv"] += (gem or math.nan) * times
                step["floor"] += floor * times
    best, label = us("sweep", "gate_up+nrl", 1, best=True)
    if best:
        lines.append(f"# gate_up with the sandwich prologue (norm_residual_linear), M=1: best {best:.2f} us ({label})")
    lines.append(f"# batch-1 step, projections only ({LAYER_LOOPS} layer-loops + lm_head): cuBLAS "
                 f"{step['cublas'] / 1e3:.2f} ms, gemv {step['gemv'] / 1e3:.2f} ms, floor {step['floor'] / 1e3:.2f} ms")
    if bench.skipped:
        lines.append(f"# out of budget, not run ({len(bench.skipped)}): {', '.join(bench.skipped[:12])}"
                     + (" ..." if len(bench.skipped) > 12 else ""))
    errors = [r for r in bench.rows if r.note.startswith("ERROR")]
    if errors:
        lines.append(f"# {len(errors)} cells failed: " + "; ".join(f"{r.shape}/M{r.rows}/{r.variant}: {r.note}"
                                                                 for r in errors[:6]))
    return lines


def run(device: str = "cuda", budget_s: float = 90.0, out: str | None = None,
        print_fn: Callable[[str], None] = print, groups: tuple[str, ...] = ()) -> Bench:
    from hal.kernels.gemv_ops import Gemv
    from hal.kernels.launch import target_of

    start = time.monotonic()
    dev = torch.device(device)
    target = target_of(dev)
    configs = configs_for(target.arch)
    units = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
    bench = Bench(dev, start + budget_s, print_fn, units)
    ops = Gemv(configs, bench.device_units)
    print_fn(f"# {target.backend} {target.arch}, {bench.device_units} SMs, torch {torch.__version__}; "
             f"configs_for({target.arch!r}): gemv_m1={configs['gemv_m1']} gemv={configs['gemv']}")
    print_fn(HEADER)
    steps = {"proj": lambda: projection_cells(bench, ops, configs), "fused": lambda: fused_cells(bench, ops, configs),
             "rotary": lambda: rotary_cells(bench, configs), "prefill": lambda: prefill_cells(bench, configs),
             "sweep": lambda: sweep_cells(bench, configs), "wide": lambda: wide_cells(bench, ops, configs)}
    for name, step in steps.items():
        if groups and name not in groups or not groups and name == "wide":
            continue
        try:
            step()
        except Exception as exc:              # setup of a group failed (memory?): say so, go on
            print_fn(f"# group failed: {type(exc).__name__}: {exc}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for line in summary(bench):
        print_fn(line)
    print_fn(f"# {time.monotonic() - start:.0f} s")
    if out:
        with open(out, "a") as f:
            for r in bench.rows:
                f.write(json.dumps(r.__dict__) + "\n")
    return bench


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=90.0, help="seconds; cells past it are listed, not run")
    parser.add_argument("--out", default=None, help="append every row as JSON lines here")
    parser.add_argument("--groups", default="", help="comma-separated groups (proj,fused,rotary,prefill,sweep,"
                        "wide); default: all but wide")
    parser.add_argument("--prefill-cases", default="", help="prompt lengths of group prefill, e.g. "
                        f"2048,8x1024 (default {','.join(PREFILL_CASES)})")
    parser.add_argument("--heads", default="", help="HEADS,KV_HEADS of groups rotary and prefill (default "
                        f"{HEADS},{KV_HEADS}: Ouro-1.4B; 48,8: Nanbeige4.2-3B)")
    args = parser.parse_args()
    if args.prefill_cases:
        PREFILL_CASES = tuple(args.prefill_cases.split(","))
    if args.heads:
        HEADS, KV_HEADS = map(int, args.heads.split(","))
    run(budget_s=args.budget, out=args.out, groups=tuple(g for g in args.groups.split(",") if g))
    sys.exit(0)
