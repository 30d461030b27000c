"""A persistent one-row projection chain: does a grid barrier stream weights faster than PDL boundaries?

    PYTHONPATH=. python tools/persistent_chain_probe.py [--model ouro-1.4b] [--layers 24] [--out rows.jsonl]
    TRITON_INTERPRET=1 PYTHONPATH=. python tools/persistent_chain_probe.py --check    # CPU: one program

Why: at batch 1 the four projections of a layer, chained with nothing between them, run at 3.3 TB/s
with the slice kernel and PDL (lever 38: 31.2-32.1 us per Ouro-1.4B layer against a floor of 24.6),
and "3.5 ms needs a persistent kernel" (docs/performance.md, "What is left"). Before building one,
this measures its core: one launch of one or two programs per SM runs every projection of the chain
(`layers` x q|k|v, o, gate|up, down; each reads the previous one's output, as tools/pdl_bench.py's
chain), a program owning a contiguous range of output rows per projection, and a grid barrier (an
arrival counter) between two projections. The weight tile after the current one is always in
flight, across the barrier too: a program that has finished projection p already streams its first
tile of p + 1 while it waits for the slowest program of p. The same run times cuBLAS and the slice
kernel with PDL on the same weights, so the ratios come from one process.

The grid must be resident at once (the barrier spins); `--programs-per-sm` beyond what fits would
hang, so it is capped at 2 with small tiles. In the interpreter programs run one after another, so
`--check` runs a single program (its barrier never waits) against torch.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl
from runtime.bench_rows import append_rows

FLOOR_BANDWIDTH = 4.27e12
FIELDS = 8         # per phase: w_off, N, K, in_off, out_off, rows per program, row chunks, K chunks


@triton.jit
def _phase(table_ptr, p, num_phases):
    """A phase's fields (int64); past the last phase, a phase of no rows (its loads are all masked)."""
    q = tl.minimum(p, num_phases - 1)
    base = table_ptr + q * 8
    live = p < num_phases
    n = tl.where(live, tl.load(base + 1), 0)
    # the table's weight offsets, K and activation offsets are multiples of 16: 16-byte loads (the hint
    # must sit on the loads here: on a call's results it is lost when the call is inlined)
    w_off = tl.multiple_of(tl.load(base), 16)
    k = tl.multiple_of(tl.load(base + 2), 16)
    in_off = tl.multiple_of(tl.load(base + 3), 16)
    return w_off, n, k, in_off, tl.load(base + 4), tl.load(base + 5), tl.load(base + 6), tl.load(base + 7)


@triton.jit
def _tile(w_ptr, pid, t, w_off, n, k, rows_per, nk, BN: tl.constexpr, KS: tl.constexpr):
    """Tile t of this program's rows of a phase: rows `[BN]`, K range `[KS]`, the weight `[BN, KS]`."""
    chunk = t // nk
    c = t - chunk * nk
    lo = pid * rows_per
    rows = lo + chunk * BN + tl.arange(0, BN)
    row_mask = (rows < lo + rows_per) & (rows < n)
    ks = c * KS + tl.arange(0, KS)
    k_mask = ks < k
    w = tl.load(w_ptr + w_off + rows.to(tl.int64)[:, None] * k + ks[None, :],
                mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    return w


@triton.jit
def _tile_at(w_ptr, table_ptr, pid, pp, tt, num_phases, BN: tl.constexpr, KS: tl.constexpr):
    w_off, n, k, _i, _o, rows_per, _c, nk = _phase(table_ptr, pp, num_phases)
    return _tile(w_ptr, pid, tt, w_off, n, k, rows_per, nk, BN, KS)


@triton.jit
def _advance(table_ptr, pp, tt, num_phases):
    """The tile after (phase pp, tile tt) in this program's stream of tiles."""
    _w, _n, _k, _i, _o, _r, chunks, nk = _phase(table_ptr, pp, num_phases)
    tt += 1
    wrap = tt >= chunks * nk
    return tl.where(wrap, pp + 1, pp), tl.where(wrap, 0, tt)


@triton.jit
def _consume(w_cur, acc, p, t, act_ptr, table_ptr, count_ptr, pid, num_programs, num_phases,
             BN: tl.constexpr, KS: tl.constexpr, SPIN: tl.constexpr):
    """Multiply tile t of phase p; store the rows it completes; arrive at the phase's end. Past the
    last phase (the loop's padding) the tile has no rows and nothing is stored."""
    w_off, n, k, in_off, out_off, rows_per, chunks, nk = _phase(table_ptr, p, num_phases)
    if SPIN and t == 0 and p > 0:          # everyone has written phase p - 1's rows (this phase's input)
        target = num_programs * tl.minimum(p, num_phases)
        arrived = tl.atomic_add(count_ptr, 0, sem="acquire")
        spins = 0
        while (arrived < target) & (spins < 1 << 24):   # bounded: a grid that is not resident
            arrived = tl.atomic_add(count_ptr, 0, sem="acquire")   # gives wrong sums, not a hang
            spins += 1
    chunk = t // nk
    c = t - chunk * nk
    ks = c * KS + tl.arange(0, KS)
    x = tl.load(act_ptr + in_off + ks, mask=ks < k, other=0.0, cache_modifier=".cg")
    acc += tl.sum(w_cur.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    if c == nk - 1:
        lo = pid * rows_per
        rows = lo + chunk * BN + tl.arange(0, BN)
        tl.store(act_ptr + out_off + rows, acc.to(act_ptr.dtype.element_ty),
                 mask=(rows < lo + rows_per) & (rows < n))
        acc = tl.zeros([BN], tl.float32)
    t += 1
    if t >= chunks * nk:                   # the phase's rows are written: arrive, go to the next
        tl.debug_barrier()                 # every thread's rows are stored before the release
        tl.atomic_add(count_ptr, 1, sem="release")
        p += 1
        t = t * 0
    return acc, p, t


@triton.jit
def _persistent_chain_kernel(act_ptr, w_ptr, table_ptr, count_ptr, num_phases, total_tiles,
                             BN: tl.constexpr, KS: tl.constexpr, SPIN: tl.constexpr):
    """Every program walks its tiles of every phase in order; four weight tiles ahead of the one it
    multiplies are in flight, across phase boundaries (weights depend on nothing). The loop body
    takes four tiles, each register tile reloaded right after it is used: a rotation of tiles
    (w0 = w1, ...) would be register moves that wait for the loads, one tile in flight."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    zero = pid * 0
    pp, tt = zero, zero                    # the prefetch cursor
    w0 = _tile_at(w_ptr, table_ptr, pid, pp, tt, num_phases, BN, KS)
    pp, tt = _advance(table_ptr, pp, tt, num_phases)
    w1 = _tile_at(w_ptr, table_ptr, pid, pp, tt, num_phases, BN, KS)
    pp, tt = _advance(table_ptr, pp, tt, num_phases)
    w2 = _tile_at(w_ptr, table_ptr, pid, pp, tt, num_phases, BN, KS)
    pp, tt = _advance(table_ptr, pp, tt, num_phases)
    w3 = _tile_at(w_ptr, table_ptr, pid, pp, tt, num_phases, BN, KS)
    pp, tt = _advance(table_ptr, pp, tt, num_phases)
    p, t = zero, zero                      # the tile multiplied now
    acc = tl.zeros([BN], tl.float32)
    for _ in range(0, total_tiles, 4):
        acc, p, t = _consume(w0, acc, p, t, act_ptr, table_ptr, count_ptr, pid, num_programs, num_phases,
                             BN, KS, SPIN)
        w0 = _tile_at(w_ptr, table_ptr, pid, pp, tt, num_phases, BN, KS)
        pp, tt = _advance(table_ptr, pp, tt, num_phases)
        acc, p, t = _consume(w1, acc, p, t, act_ptr, table_ptr, count_ptr, pid, num_programs, num_phases,
                             BN, KS, SPIN)
        w1 = _tile_at(w_ptr, table_ptr, pid, pp, tt, num_phases, BN, KS)
        pp, tt = _advance(table_ptr, pp, tt, num_phases)
        acc, p, t = _consume(w2, acc, p, t, act_ptr, table_ptr, count_ptr, pid, num_programs, num_phases,
                             BN, KS, SPIN)
        w2 = _tile_at(w_ptr, table_ptr, pid, pp, tt, num_phases, BN, KS)
        pp, tt = _advance(table_ptr, pp, tt, num_phases)
        acc, p, t = _consume(w3, acc, p, t, act_ptr, table_ptr, count_ptr, pid, num_programs, num_phases,
                             BN, KS, SPIN)
        w3 = _tile_at(w_ptr, table_ptr, pid, pp, tt, num_phases, BN, KS)
        pp, tt = _advance(table_ptr, pp, tt, num_phases)


class Chain:
    """The flat weights and activations of `layers` x shapes, and the phase table of one grid."""

    def __init__(self, weights: list[torch.Tensor], x0: torch.Tensor, num_programs: int, bn: int):
        dev = x0.device
        self.w = torch.cat([w.reshape(-1) for w in weights])
        sizes = [x0.numel()] + [w.shape[0] for w in weights]
        offs = [0]
        for s in sizes:
            offs.append(offs[-1] + s)
        self.act = torch.zeros(offs[-1], dtype=x0.dtype, device=dev)
        self.act[:x0.numel()] = x0.reshape(-1)
        rows, w_off = [], 0
        if any(o % 16 for o in offs) or any(w.shape[1] % 16 for w in weights):
            raise ValueError("the kernel reads in 16-element vectors: K and every activation size a "
                             "multiple of 16")
        for i, w in enumerate(weights):
            n, k = w.shape
            rows_per = -(-n // num_programs)
            rows.append([w_off, n, k, offs[i], offs[i + 1], rows_per, -(-rows_per // bn), 0])
            w_off += n * k
        self.rows = rows
        self.offs = offs
        self.count = torch.zeros(1, dtype=torch.int32, device=dev)
        self.bn = bn
        self.num_programs = num_programs

    def table(self, ks: int) -> torch.Tensor:
        t = [r[:7] + [-(-r[2] // ks)] for r in self.rows]
        return torch.tensor(t, dtype=torch.int64, device=self.act.device).reshape(-1)

    def output(self, i: int) -> torch.Tensor:
        return self.act[self.offs[i + 1]:self.offs[i + 2]]


def persistent_launcher(chain: Chain, bn: int, ks: int, warps: int, spin: bool = True):
    table = chain.table(ks)
    total_tiles = sum(r[6] * -(-r[2] // ks) for r in chain.rows)

    def launch():
        chain.count.zero_()
        _persistent_chain_kernel[(chain.num_programs,)](
            chain.act, chain.w, table, chain.count, len(chain.rows), total_tiles,
            BN=bn, KS=ks, SPIN=spin, num_warps=warps, num_stages=1)
    return launch


def reference(weights: list[torch.Tensor], x0: torch.Tensor) -> torch.Tensor:
    """The chain in torch at the kernel's rounding: fp32 sums, each output rounded to the input dtype."""
    prev = x0.reshape(-1)
    for w in weights:
        prev = (w.float() @ prev[:w.shape[1]].float()).to(x0.dtype)
    return prev


def check() -> int:
    """CPU (interpreter): one program runs a small chain; the result against torch."""
    torch.manual_seed(0)
    shapes = ((96, 64), (64, 96), (160, 64), (64, 160))
    weights = [torch.randn(n, k, dtype=torch.float32) / k ** 0.5 for _ in range(2) for n, k in shapes]
    x0 = torch.randn(96, dtype=torch.float32)
    worst = 0.0
    for bn, ks in ((4, 32), (8, 64), (2, 128)):
        chain = Chain(weights, x0, 1, bn)
        persistent_launcher(chain, bn, ks, 1)()
        want = reference(weights, x0)
        got = chain.output(len(weights) - 1)
        err = float((got - want).abs().max())
        worst = max(worst, err)
        print(f"bn {bn} ks {ks}: max |diff| {err:.3g}")
    ok = worst < 1e-4
    print("check", "OK" if ok else "FAILED")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="ouro-1.4b")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--out", default=None)
    p.add_argument("--check", action="store_true", help="CPU interpreter: one program against torch")
    args = p.parse_args()
    if args.check:
        return check()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import pdl_bench as bench                   # the chain's baselines and graph timer
    torch.manual_seed(0)
    shapes = bench.MODEL_SHAPES[args.model]
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
               for _ in range(args.layers) for _, n, k in shapes]
    kmax = max(k for _, _, k in shapes)
    x0 = torch.randn(1, kmax, device="cuda", dtype=torch.bfloat16)
    layer_bytes = sum(n * k * 2 for _, n, k in shapes)
    floor_us = layer_bytes / FLOOR_BANDWIDTH * 1e6
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"torch {torch.__version__} triton {triton.__version__}; {sms} SMs; per layer {layer_bytes / 1e6:.1f} MB, "
          f"floor {floor_us:.1f} us", flush=True)
    want = reference(weights, x0).float()
    results = []

    def report(name, us, y):
        per_layer = us / args.layers
        rel = float((y.float() - want).norm() / want.norm())
        row = {"model": args.model, "variant": name, "us_per_layer": round(per_layer, 2),
               "tb_s": round(layer_bytes / per_layer / 1e6, 3), "floor_ratio": round(floor_us / per_layer, 3),
               "rel_diff_vs_fp32_chain": rel}
        results.append(row)
        print(f"{name:50s} {per_layer:7.2f} us/layer  {row['tb_s']:.2f} TB/s  {row['floor_ratio']:.2f} of floor  "
              f"rel {rel:.2g}", flush=True)

    from hal.kernels.configs import KernelConfig
    slices = [(f"gemv_slice bn4 bk2048 w{w} pdl",
               bench.slice_gemv_launcher(True, KernelConfig(1, 4, w, 1, block_k=2048))) for w in (4, 2)]
    for name, launch in [("cublas", bench.cublas_launch)] + slices:
        try:
            us, y = bench.time_graph(launch, weights, x0)
            report(name, us, y.reshape(-1))
        except Exception as e:  # noqa: BLE001 (reported, not fatal)
            print(f"{name:40s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    for per_sm, bn, ks, warps, spin in ((1, 4, 2048, 8, True), (2, 2, 2048, 4, True), (2, 4, 1024, 4, True),
                                        (4, 2, 1024, 2, True), (5, 2, 1024, 2, True), (1, 8, 1024, 8, True),
                                        (2, 2, 2048, 4, False), (4, 2, 1024, 2, False)):
        name = f"persistent {per_sm}/SM bn{bn} ks{ks} w{warps}{'' if spin else ' no barrier (wrong sums)'}"
        try:
            chain = Chain(weights, x0.reshape(-1), sms * per_sm, bn)
            us = bench.graph_median_us(persistent_launcher(chain, bn, ks, warps, spin))
            report(name, us, chain.output(len(weights) - 1))
        except Exception as e:  # noqa: BLE001
            print(f"{name:40s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    append_rows(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
