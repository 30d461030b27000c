"""Persistent one-row projections fed by TMA (Gluon, sm_90): do asynchronous copy rings stream weights
at the copy rate across grid barriers, and does a layer's MLP block in one launch beat its kernels?

    PYTHONPATH=. python tools/persistent_tma_probe.py chain  [--model ouro-1.4b] [--layers 24] [--fp8]
    PYTHONPATH=. python tools/persistent_tma_probe.py block  [--model nanbeige4.2-3b] [--layers 16]
    PYTHONPATH=. python tools/persistent_tma_probe.py compile     # CPU: sm_90 code, registers, shared memory
    (--out rows.jsonl appends the rows)

Why: lever 96 (tools/persistent_chain_probe.py) ran the whole chain of one-row products of 24 layers in
one launch with grid barriers between products and lost (2.49 TB/s at best, the slice kernel with PDL
3.3): Triton keeps a register-held load in flight only until its registers are touched. Here each
program (one or two per SM) keeps `STAGES` stages of weight tiles in flight as TMA copies into shared
memory, each stage with an mbarrier that says when its bytes have landed. The copies run ahead of the
products across the grid barriers (weights depend on nothing), so while the slowest program finishes
product p the others already stream their tiles of p + 1.

- A stage is BOXES boxes of [BN rows, BK] side by side along K. A product's rows are cut in chunks of
  BN rows dealt round-robin to the programs (8-row chunks keep every product within 3% of balanced at
  one program per SM); programs with no rows of a product only arrive at its barrier.
- Each product's input vector is loaded once, after the barrier, into shared memory (one L2 round
  trip per product). That staging is where a prologue costs nothing extra: every program holds the
  whole vector, so the residual add and RMSNorm before gate|up, and SwiGLU before down, run there.
- The weights of products that share K are stacked into one [rows, K] tensor with one tensor
  descriptor (at most three Ks); a phase table says, per product: descriptor, first row, N, K stages,
  input and output offsets, chunks, K, the staging kind, and the residual, norm weight and residual
  output offsets (all vectors live in one buffer).

How a phase waits for its input (lever 102, thirtieth session): a grid barrier (an arrival counter
per phase, then one L2 round trip to stage the input: about 2 us per boundary in lever 97), or a
sentinel: every output is NaN before the launch (one index_fill, timed with it) and a phase reloads
its input until none of what it reads is NaN, so the wait and the staging are one loop of loads
and no program counts arrivals (each element is written once: seeing its value is enough).

Modes: `chain`: every projection of `layers` layers (q|k|v, o, gate|up, down) in one launch, against
cuBLAS and the slice kernel on the same weights, plain (each product reads the first K of the one
before) and with down reading SwiGLU of all of gate|up as the model's does, then one product alone
(the ring's streaming rate).
`block`: per layer one launch of o, gate|up (residual add + RMSNorm staged) and down (SwiGLU staged),
against the sequence a pre-norm model's decode step runs now: cuBLAS o, the Hal's `norm_add_norm`,
cuBLAS gate|up, `silu_and_mul`, cuBLAS down (PDL on where the Hal's kernels take it).

Written against Triton 3.6's Gluon (the H200's; 3.9 renamed `_reinterpret` and the TMA copy: `compile`
needs a 3.6, e.g. `pip install --target DIR triton==3.6.0` and PYTHONPATH=DIR). Outcomes:
docs/performance.md levers 97 and 102, rows in docs/data/h200-s27-tma-probe.jsonl.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from runtime.bench_rows import append_rows

FLOOR_BANDWIDTH = 4.27e12
FIELDS = 12   # per phase: descriptor, first row, N, K stages, in, out, chunks, K, kind, residual, norm weight,
#               residual out
PLAIN, ADD_NORM, SWIGLU = 0, 1, 2   # how a phase stages its input vector


@gluon.jit
def _my_chunks(chunks, pid, num_programs):
    """Chunks c < chunks with c % num_programs == pid."""
    return (chunks - pid + num_programs - 1) // num_programs


@gluon.jit
def _phase(table_ptr, q, end, pid, num_programs):
    """Phase q's fields (from `end` on: the last one's, never consumed): descriptor, first row, N, K
    stages, input and output offsets, this program's chunks, K."""
    base = table_ptr + gl.minimum(q, end - 1) * 12
    mine = _my_chunks(gl.load(base + 6).to(gl.int32), pid, num_programs)
    return (gl.load(base).to(gl.int32), gl.load(base + 1).to(gl.int32), gl.load(base + 2).to(gl.int32),
            gl.load(base + 3).to(gl.int32), gl.load(base + 4), gl.load(base + 5), mine,
            gl.load(base + 7).to(gl.int32))


@gluon.jit
def _next_phase(table_ptr, q, end, pid, num_programs):
    """The first phase from q on where this program has rows (`end` if none), and its fields."""
    desc, row, _n, stages, _i, _o, mine, _k = _phase(table_ptr, q, end, pid, num_programs)
    while (q < end) & (mine == 0):
        q += 1
        desc, row, _n, stages, _i, _o, mine, _k = _phase(table_ptr, q, end, pid, num_programs)
    return q, desc, row, stages, mine


@gluon.jit
def _arrive_empty(table_ptr, count_ptr, q, end, pid, num_programs, ARRIVE: gl.constexpr):
    """Arrive at every phase from q on where this program has no rows; the first one where it has.
    Without ARRIVE (sentinel waits: nobody counts arrivals) only skip them."""
    mine = _phase(table_ptr, q, end, pid, num_programs)[6]
    while (q < end) & (mine == 0):
        if ARRIVE:
            gl.atomic_add(count_ptr + q, 1, sem="release")
        q += 1
        mine = _phase(table_ptr, q, end, pid, num_programs)[6]
    return q


@gluon.jit
def _issue(d0, d1, d2, bars, bufs, slot, live, desc, row, kk, BK: gl.constexpr, BOXES: gl.constexpr):
    """TMA of stage kk of the chunk at `row` (BOXES boxes of [BN, BK] along K; zeros past K) of
    descriptor `desc` into ring slot `slot`."""
    bar = bars.index(slot)
    mbarrier.expect(bar, BOXES * d0.block_type.nbytes, pred=live)
    for b in gl.static_range(BOXES):
        col = (kk * BOXES + b) * BK
        buf = bufs.index(slot * BOXES + b)
        if desc == 0:
            tma.async_copy_global_to_shared(d0, [row, col], bar, buf, pred=live)
        elif desc == 1:
            tma.async_copy_global_to_shared(d1, [row, col], bar, buf, pred=live)
        else:
            tma.async_copy_global_to_shared(d2, [row, col], bar, buf, pred=live)


@gluon.jit
def _issue_next(d0, d1, d2, bars, bufs, slot, table_ptr, end, pid, num_programs, pp, jj, kk, p_desc, p_row,
                p_stages, p_mine, BN: gl.constexpr, BK: gl.constexpr, BOXES: gl.constexpr):
    """Issue the producer's stage (phase pp, my chunk jj, stage kk) into `slot`; return the cursor moved
    on by one stage, with the fields of its phase."""
    _issue(d0, d1, d2, bars, bufs, slot, pp < end, p_desc, p_row + (pid + jj * num_programs) * BN, kk, BK, BOXES)
    kk += 1
    if kk == p_stages:
        kk = kk * 0
        jj += 1
        if jj == p_mine:
            jj = jj * 0
            pp, p_desc, p_row, p_stages, p_mine = _next_phase(table_ptr, pp + 1, end, pid, num_programs)
    return pp, jj, kk, p_desc, p_row, p_stages, p_mine


@gluon.jit
def _has_nan(v, inside):
    return gl.max(gl.where(inside & (v != v), 1, 0), axis=0) > 0


@gluon.jit
def _stage_input(act_ptr, table_ptr, x_smem, p, pid, k_stages, kdim, eps, poll,
                 x_layout: gl.constexpr, XN: gl.constexpr, BK: gl.constexpr, STAGE_K: gl.constexpr,
                 POLL: gl.constexpr, BACKOFF: gl.constexpr = False):
    """Phase p's input vector into shared memory (bf16, zeros past K), after its prologue: plain, the
    residual add + RMSNorm (program 0 also stores the new residual), or SwiGLU of [gate | up].
    POLL (and `poll` true: an input some program of this launch writes): the input was NaN before
    the launch, so reload it until none of what this phase reads is NaN: every element is written
    once, so seeing its value is all the synchronisation it needs (no counter, no fence). BACKOFF:
    sleep ~128 ns before each reload, so that waiting programs do not take L2 bandwidth from the
    ones still streaming (every spin reloads the whole vector: up to 21 KB at Nanbeige's down)."""
    base = table_ptr + p * 12
    # every offset and K is a multiple of 16 (Vectors): 16-byte loads, if the hints sit on the loads here
    in_off = gl.multiple_of(gl.load(base + 4), 16)
    kind = gl.load(base + 8)
    xi = gl.arange(0, XN, layout=x_layout)
    k_whole = (kdim // BK) * BK               # K is a multiple of BK (Plan): a product the analysis can see
    inside = xi < k_whole
    # masked by whole stages (16-byte loads; the buffer has a stage of padding), then zeros past K
    live = xi < k_stages * STAGE_K
    x = gl.load(act_ptr + in_off + xi, mask=live, other=0.0, cache_modifier=".cg")
    # SwiGLU's up half (nothing is read for the other kinds)
    up = inside & (kind == 2)
    u = gl.load(act_ptr + in_off + k_whole + xi, mask=up, other=0.0, cache_modifier=".cg")
    if POLL:
        missing = poll & (_has_nan(x, inside) | _has_nan(u, up))
        spins = 0
        while missing & (spins < 1 << 20):    # bounded: a grid not all resident gives NaN sums, not a hang
            if BACKOFF:
                gl.inline_asm_elementwise("nanosleep.u32 128; // dummy $0", "=r", [], dtype=gl.int32,
                                          is_pure=False, pack=1)
            x = gl.load(act_ptr + in_off + xi, mask=live, other=0.0, volatile=True)
            u = gl.load(act_ptr + in_off + k_whole + xi, mask=up, other=0.0, volatile=True)
            missing = _has_nan(x, inside) | _has_nan(u, up)
            spins += 1
    if kind == 1:
        r = gl.load(act_ptr + gl.multiple_of(gl.load(base + 9), 16) + xi, mask=live, other=0.0, cache_modifier=".cg")
        h = (x.to(gl.float32) + r.to(gl.float32)).to(act_ptr.dtype.element_ty)
        if pid == 0:
            gl.store(act_ptr + gl.multiple_of(gl.load(base + 11), 16) + xi, h, mask=inside)
        hf = gl.where(inside, h.to(gl.float32), 0.0)
        rstd = gl.rsqrt(gl.sum(hf * hf, axis=0) / kdim.to(gl.float32) + eps)
        w = gl.load(act_ptr + gl.multiple_of(gl.load(base + 10), 16) + xi, mask=inside, other=0.0).to(gl.float32)
        x = ((hf * rstd).to(act_ptr.dtype.element_ty).to(gl.float32) * w).to(act_ptr.dtype.element_ty)
    elif kind == 2:
        g = x.to(gl.float32)
        x = ((g / (1.0 + gl.exp(-g))).to(act_ptr.dtype.element_ty).to(gl.float32) * u.to(gl.float32)).to(
            act_ptr.dtype.element_ty)
    gl.thread_barrier()                       # the phase before has read x_smem
    x_smem.store(gl.where(inside, x, 0.0))
    gl.thread_barrier()


@gluon.jit
def _fma(acc, w, x_tiles, t, cols_layout: gl.constexpr):
    """acc [BN, BK] += w * x of K tile t."""
    return acc + w.to(gl.float32) * x_tiles.index(t).load(cols_layout).to(gl.float32)[None, :]


@gluon.jit
def _tma_chain_kernel(d0, d1, d2, act_ptr, table_ptr, count_ptr, first, end, eps,
                      BN: gl.constexpr, BK: gl.constexpr, BOXES: gl.constexpr, VEC: gl.constexpr,
                      STAGES: gl.constexpr, XT: gl.constexpr, WAIT: gl.constexpr, PDL: gl.constexpr,
                      num_warps: gl.constexpr):
    """Phases [first, end) of the table, in order. WAIT: how a phase waits for its input, the phase
    before: 1 a grid barrier (an arrival counter per phase), 2 polling the input itself (outputs are
    NaN before the launch: `_stage_input`), 3 the same with a short sleep between polls, 0 not at
    all (wrong sums: a bound)."""
    pid = gl.program_id(0)
    num_programs = gl.num_programs(0)
    # a lane reads 16 bytes (VEC weights), a warp whole rows of BK; the warps split a box's rows
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // BK, BK // VEC], [num_warps, 1], [1, 0])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, layout)
    x_layout: gl.constexpr = gl.BlockedLayout([8], [32], [num_warps], [0])
    bufs = gl.allocate_shared_memory(d0.dtype, [STAGES * BOXES, BN, BK], d0.layout)
    x_flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    x_smem = gl.allocate_shared_memory(act_ptr.dtype.element_ty, [XT * BK], x_flat)     # one phase's input
    x_tiles = x_smem._reinterpret(act_ptr.dtype.element_ty, [XT, BK], x_flat)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()

    total = pid * 0
    for q in range(first, end):
        base = table_ptr + q * 12
        total += _my_chunks(gl.load(base + 6).to(gl.int32), pid, num_programs) * gl.load(base + 3).to(gl.int32)

    # the producer's cursor (phase pp, my chunk jj, stage kk) runs STAGES stages ahead of the consumer;
    # the first ones go out before the PDL wait (weights depend on no kernel)
    jj = pid * 0
    kk = pid * 0
    pp, p_desc, p_row, p_stages, p_mine = _next_phase(table_ptr, first, end, pid, num_programs)
    for s in gl.static_range(STAGES):
        pp, jj, kk, p_desc, p_row, p_stages, p_mine = _issue_next(
            d0, d1, d2, bars, bufs, s, table_ptr, end, pid, num_programs, pp, jj, kk, p_desc, p_row, p_stages,
            p_mine, BN, BK, BOXES)
    if PDL:   # the next launch may start its own ring now (where its programs fit beside ours); then
        #       wait for the launch before ours to finish and flush
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    # the consumer: phase p, my chunk j, stage k; phases where it has no rows it only arrives at
    p = _arrive_empty(table_ptr, count_ptr, first, end, pid, num_programs, WAIT < 2)
    j = pid * 0
    k = pid * 0
    _d, _r, n, k_stages, _i, out_off, mine, kdim = _phase(table_ptr, p, end, pid, num_programs)
    acc = gl.zeros([BN, BK], gl.float32, layout)   # summed over K only when a chunk is done
    for i in range(total):
        if (j == 0) & (k == 0):
            if (WAIT == 1) & (p > first):     # every program has written phase p - 1 (this one's input)
                arrived = gl.load(count_ptr + p - 1, volatile=True)
                spins = 0
                while (arrived < num_programs) & (spins < 1 << 20):   # bounded: a grid not all resident
                    arrived = gl.load(count_ptr + p - 1, volatile=True)   # gives wrong sums, not a hang
                    spins += 1
                gl.atomic_add(count_ptr + p - 1, 0, sem="acquire")    # the writers' rows are visible
                gl.thread_barrier()           # to every warp, after the one thread's acquire
            _stage_input(act_ptr, table_ptr, x_smem, p, pid, k_stages, kdim, eps, p > first, x_layout, XT * BK,
                         BK, BOXES * BK, WAIT >= 2, WAIT == 3)
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        w0 = bufs.index(slot * BOXES).load(layout)
        if BOXES > 1:
            w1 = bufs.index(slot * BOXES + 1).load(layout)
        if BOXES > 2:
            w2 = bufs.index(slot * BOXES + 2).load(layout)
            w3 = bufs.index(slot * BOXES + 3).load(layout)
        gl.thread_barrier()                   # every warp has read the slot before it is refilled
        pp, jj, kk, p_desc, p_row, p_stages, p_mine = _issue_next(
            d0, d1, d2, bars, bufs, slot, table_ptr, end, pid, num_programs, pp, jj, kk, p_desc, p_row, p_stages,
            p_mine, BN, BK, BOXES)
        acc = _fma(acc, w0, x_tiles, k * BOXES, cols_layout)
        if BOXES > 1:
            acc = _fma(acc, w1, x_tiles, k * BOXES + 1, cols_layout)
        if BOXES > 2:
            acc = _fma(acc, w2, x_tiles, k * BOXES + 2, cols_layout)
            acc = _fma(acc, w3, x_tiles, k * BOXES + 3, cols_layout)
        k += 1
        if k == k_stages:
            rows = (pid + j * num_programs) * BN + gl.arange(0, BN, layout=rows_layout)
            gl.store(act_ptr + out_off + rows, gl.sum(acc, axis=1).to(act_ptr.dtype.element_ty), mask=rows < n)
            acc = gl.zeros([BN, BK], gl.float32, layout)
            k = k * 0
            j += 1
            if j == mine:                     # this program's rows of phase p are written: arrive
                if WAIT < 2:
                    gl.thread_barrier()
                    gl.atomic_add(count_ptr + p, 1, sem="release")
                j = j * 0
                p = _arrive_empty(table_ptr, count_ptr, p + 1, end, pid, num_programs, WAIT < 2)
                _d, _r, n, k_stages, _i, out_off, mine, kdim = _phase(table_ptr, p, end, pid, num_programs)


class Vectors:
    """One bf16 buffer for every vector the phases read and write; `add` returns an offset."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.size = 0

    def add(self, v: torch.Tensor | int) -> int:
        v = torch.zeros(v, dtype=torch.bfloat16) if isinstance(v, int) else v.detach().reshape(-1).cpu()
        off = self.size
        pad = -(-v.numel() // 16) * 16              # 16-element starts: 16-byte vector loads
        self.parts.append(torch.cat([v.to(torch.bfloat16), v.new_zeros(pad - v.numel(), dtype=torch.bfloat16)]))
        self.size += pad
        return off


class Plan:
    """The stacked weights (one descriptor per K), the vector buffer and the phase table.

    `phases`: (weight [N, K], input offset, output offset, kind, residual, norm weight, residual out)."""

    def __init__(self, phases: list[tuple], vectors: Vectors, num_programs: int, bn: int, bk: int, boxes: int,
                 device: str = "cuda"):
        weights = [ph[0] for ph in phases]
        ks = sorted({w.shape[1] for w in weights})
        if len(ks) > 3:
            raise ValueError(f"at most three distinct K, got {ks}")
        if any(k % bk for k in ks):
            raise ValueError(f"every K a multiple of BK={bk}: {ks}")
        groups = {k: [w for w in weights if w.shape[1] == k] for k in ks}
        self.stacks = [torch.cat(groups[k]) for k in ks]
        first_row, rows = {}, []
        for k in ks:
            row = 0
            for w in groups[k]:
                first_row[id(w)] = row
                row += w.shape[0]
        stage_k = bk * boxes
        for w, in_off, out_off, kind, res, norm, res_out in phases:
            n, k = w.shape
            rows.append([ks.index(k), first_row[id(w)], n, -(-k // stage_k), in_off, out_off, -(-n // bn), k,
                         kind, res, norm, res_out])
        self.table = torch.tensor(rows, dtype=torch.int64, device=device).reshape(-1)
        self.num_phases = len(rows)
        # a stage of padding: the staging loads whole stages
        self.act = torch.cat([*vectors.parts, torch.zeros(2 * stage_k, dtype=torch.bfloat16)]).to(device)
        self.count = torch.zeros(len(rows), dtype=torch.int32, device=device)   # arrivals per phase
        layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=weights[0].element_size() * 8, rank=2)
        descs = [TensorDescriptor.from_tensor(s, [bn, bk], layout) for s in self.stacks]
        self.descs = (descs + [descs[0]] * 3)[:3]
        self.num_programs = num_programs
        self.x_tiles = triton.next_power_of_2(max(-(-k // stage_k) * boxes for k in ks))

    def vector(self, off: int, n: int) -> torch.Tensor:
        return self.act[off:off + n]


WAITS = {"barrier": 1, "sentinel": 2, "sentinel-backoff": 3, "none": 0}
LABELS = {"barrier": "", "sentinel": " sentinel", "sentinel-backoff": " sentinel backoff",
          "none": " no barrier (wrong sums)"}


def _check_sentinels(plan: Plan, spans: list[tuple[int, int]], outputs: list[tuple[int, int]]) -> None:
    """Sentinel waits are only as good as the poison: every element a phase after its span's first
    polls (K of its input, 2K for SwiGLU's gate|up) must be NaN before the launch, and what it reads
    unpolled (ADD_NORM's residual and norm weight) must be written by no phase of its span."""
    poisoned = torch.zeros(plan.act.numel(), dtype=torch.bool)
    for off, n in outputs:
        poisoned[off:off + n] = True
    table = plan.table.view(-1, FIELDS).tolist()
    for first, end in spans:
        written = torch.zeros_like(poisoned)
        for row in table[first:end]:
            written[row[5]:row[5] + row[2]] = True
            if row[8] == ADD_NORM:
                written[row[11]:row[11] + row[7]] = True
        for p in range(first + 1, end):
            _d, _r, _n, _s, in_off, _o, _c, k, kind, res, norm, _ro = table[p]
            polled = poisoned[in_off:in_off + (2 * k if kind == SWIGLU else k)]
            if not polled.all():
                raise ValueError(f"phase {p} polls elements {in_off}.. that `outputs` does not poison")
            if kind == ADD_NORM and (written[res:res + k].any() or written[norm:norm + k].any()):
                raise ValueError(f"phase {p} reads a residual or norm weight its launch writes (not polled)")


def launcher(plan: Plan, cfg: tuple, spans: list[tuple[int, int]], wait: str = "barrier", pdl: bool = False,
             eps: float = 1e-6, outputs: list[tuple[int, int]] = ()):
    """One launch per span of phases (`[(first, end)]`). Before them the arrival counters are zeroed
    (`wait="barrier"`) or the phases' `outputs` (offset, length) set to NaN (`wait="sentinel"`: one
    index_fill, part of what is timed)."""
    _per_sm, bn, bk, boxes, stages, warps = cfg
    if boxes not in (1, 2, 4):
        raise ValueError(f"boxes per stage: 1, 2 or 4, got {boxes}")
    poisoned = None
    if wait.startswith("sentinel"):
        poisoned = torch.cat([torch.arange(off, off + n) for off, n in outputs]).to(plan.act.device)
        _check_sentinels(plan, spans, outputs)

    def launch():
        if poisoned is None:
            plan.count.zero_()
        else:
            plan.act.index_fill_(0, poisoned, float("nan"))
        for first, end in spans:
            extra = {"launch_pdl": True} if pdl else {}
            _tma_chain_kernel[(plan.num_programs,)](
                *plan.descs, plan.act, plan.table, plan.count, first, end, eps, BN=bn, BK=bk, BOXES=boxes,
                VEC=16 // plan.stacks[0].element_size(), STAGES=stages, XT=plan.x_tiles, WAIT=WAITS[wait], PDL=pdl,
                num_warps=warps, **extra)
    return launch


CONFIGS = (  # programs per SM, BN, BK, boxes per stage, stages, warps
    # calls 1-2 (2026-12-04): one to eight programs per SM of 1-8 warps with one box per stage paid a
    # CTA-wide barrier and a fence per 4-16 KiB; call 3: one product alone streams at 4.3-4.4 TB/s, so the
    # chain lost at its 96 boundaries (with 16-32-row chunks half the programs had no rows of o and
    # down); call 4: 8-row chunks, 2-4 boxes per stage. The best of call 4 first.
    (1, 16, 256, 2, 6, 4), (1, 16, 256, 4, 4, 8), (1, 8, 256, 4, 6, 4), (2, 8, 256, 4, 3, 4),
    (1, 8, 256, 4, 8, 8), (2, 8, 256, 2, 4, 4),
)

BLOCK_CONFIGS = ((1, 16, 256, 4, 4, 8), (1, 16, 256, 2, 6, 4), (1, 8, 256, 4, 8, 8), (1, 16, 256, 2, 3, 8),
                 # call 8: at most half an SM's shared memory and registers, so that with PDL the next
                 # launch's programs fit beside ours and fill their rings while ours finish (they spill)
                 (1, 16, 256, 2, 3, 4), (1, 8, 256, 4, 2, 4), (1, 16, 256, 4, 2, 4))


def compile_only() -> int:
    """CPU: compile each config for sm_90 (no GPU: descriptors over host tensors) and print its resources."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    sys.path.insert(0, os.path.dirname(__file__))
    from xcompile import _nvidia_resources

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    fn = _tma_chain_kernel
    failed = 0
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        vec = Vectors()
        x, y, z, z2 = vec.add(512), vec.add(512), vec.add(256), vec.add(256)
        weights = [torch.zeros(n, k, dtype=dtype) for n, k in ((512, 256), (256, 512), (256, 256))]
        phases = [(weights[0], x, y, PLAIN, 0, 0, 0), (weights[1], y, z, ADD_NORM, x, x, z),
                  (weights[2], y, z2, SWIGLU, 0, 0, 0)]
        for cfg, wait in ((c, w) for c in CONFIGS for w in sorted(set(WAITS.values()))):
            _per_sm, bn, bk, boxes, stages, warps = cfg
            plan = Plan(phases, vec, 4, bn, bk, boxes, device="cpu")
            kwargs = {"BN": bn, "BK": bk, "BOXES": boxes, "VEC": 16 // dtype.itemsize, "STAGES": stages,
                      "XT": plan.x_tiles, "WAIT": wait, "PDL": True, "num_warps": warps, "debug": False}
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, specialization, options = binder(*plan.descs, plan.act, plan.table, plan.count, 0, 3, 1e-6,
                                                    **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
            name = f"{str(dtype)[6:]} {cfg} wait {wait}"
            try:
                k = triton_compile(GluonASTSource(fn, signature, constexprs, attrs), target=target,
                                   options=options.__dict__)
                print(f"{name}: shared {k.metadata.shared} {_nvidia_resources(k.asm['cubin'])}")
            except Exception as e:  # noqa: BLE001 (reported)
                failed += 1
                print(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}")
    return 1 if failed else 0


class Report:
    def __init__(self, model: str, dtype, layers: int, layer_bytes: int) -> None:
        self.rows, self.model, self.dtype, self.layers, self.layer_bytes = [], model, str(dtype), layers, layer_bytes
        self.floor_us = layer_bytes / FLOOR_BANDWIDTH * 1e6

    def __call__(self, name: str, us: float, rel: float) -> None:
        per = us / self.layers
        row = {"model": self.model, "dtype": self.dtype, "variant": name, "us_per_layer": round(per, 2),
               "tb_s": round(self.layer_bytes / per / 1e6, 3), "floor_ratio": round(self.floor_us / per, 3),
               "rel_diff": rel}
        self.rows.append(row)
        print(f"{name:52s} {per:7.2f} us/layer  {row['tb_s']:.2f} TB/s  {row['floor_ratio']:.2f} of floor  "
              f"rel {rel:.2g}", flush=True)


def _fresh_run(plan: Plan, launch, outputs: list[tuple[int, int]]) -> None:
    """One more run with every output poisoned (NaN) first: after the timed replays of the same inputs
    the buffer already holds the right values, so a phase that read its input too early would
    otherwise still look right."""
    for off, n in outputs:
        plan.act[off:off + n] = float("nan")
    launch()
    torch.cuda.synchronize()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error; absolute where `want` is all zeros (NaN only where `got` holds one)."""
    diff, norm = (got.float() - want.float()).norm(), want.float().norm()
    return float(diff / norm if norm > 0 else diff)


def _worst(rels: list[float]) -> float:
    """The largest error, NaN if any is (`max` would skip a NaN that is not first)."""
    return float("nan") if any(math.isnan(r) for r in rels) else max(rels)


def _chain_reference(weights: list[torch.Tensor], kinds: list[int], x0: torch.Tensor) -> list[torch.Tensor]:
    """Every product of the chain in float32, rounded to bf16 between them as the kernel stores them:
    each reads the first K of the one before, or SwiGLU of its two halves (`_stage_input`'s roundings).
    With SwiGLU the values shrink doubly exponentially (a product of two products per layer) and reach
    zero after about six layers of random weights, so the chain is checked product by product."""
    y, products = x0.reshape(-1), []
    for w, kind in zip(weights, kinds):
        k = w.shape[1]
        if kind == SWIGLU:
            g = y[:k].float()
            x = ((g / (1.0 + torch.exp(-g))).to(y.dtype).float() * y[k:2 * k].float()).to(y.dtype)
        else:
            x = y[:k]
        y = (w.float() @ x.float()).to(x0.dtype)
        products.append(y)
    return products


def run_chain(args, bench, sms: int) -> list[dict]:
    shapes = bench.MODEL_SHAPES[args.model]
    wdtype = torch.float8_e4m3fn if args.fp8 else torch.bfloat16
    weights = [(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5).to(wdtype)
               for _ in range(args.layers) for _, n, k in shapes]
    x0 = torch.randn(1, max(k for _, _, k in shapes), device="cuda", dtype=torch.bfloat16)
    report = Report(args.model, wdtype, args.layers, sum(n * k * weights[0].element_size() for _, n, k in shapes))
    print(f"chain: {args.model} {wdtype}, {args.layers} layers, {report.layer_bytes / 1e6:.1f} MB and floor "
          f"{report.floor_us:.1f} us per layer; {sms} SMs", flush=True)
    want = x0.reshape(-1)
    for w in weights:
        want = (w.float() @ want[:w.shape[1]].float()).to(x0.dtype)

    from hal.kernels.configs import KernelConfig
    slice_config = KernelConfig(1, 4, 4, 1, block_k=2048)
    if args.fp8:   # the engine's FP8 one-row path: the slice kernel with a scale per row (ones here)
        scales = {n: torch.ones(n, device="cuda", dtype=torch.float32) for _, n, _ in shapes}
        baselines = [("gemv_slice fp8 bn4 bk2048 w4 pdl", bench.slice_gemv_launcher(True, slice_config, scales))]
    else:
        baselines = [("cublas", bench.cublas_launch),
                     ("gemv_slice bn4 bk2048 w4 pdl", bench.slice_gemv_launcher(True, slice_config))]
    for name, launch in baselines:
        us, y = bench.time_graph(launch, weights, x0)
        report(name, us, _rel(y.reshape(-1), want))
    vec = Vectors()
    offs = [vec.add(x0)] + [vec.add(w.shape[0]) for w in weights]
    outputs = [(off, w.shape[0]) for off, w in zip(offs[1:], weights)]
    for swiglu in (False, True):
        # `swiglu`: down reads SwiGLU of gate|up's whole output, as the model's does, so that a phase
        # that waits on its input itself (sentinel) waits for all of it; plain, each product reads the
        # first K of the one before (o: the q third of q|k|v, down: the gate half), which only the grid
        # barrier waits for in full
        kinds = [SWIGLU if swiglu and name == "down" else PLAIN for _ in range(args.layers) for name, _, _ in shapes]
        phases = [(w, offs[i], offs[i + 1], kind, 0, 0, 0) for i, (w, kind) in enumerate(zip(weights, kinds))]
        wants = _chain_reference(weights, kinds, x0)
        for cfg in CONFIGS[:args.configs]:
            for wait in WAITS:
                name = f"tma {cfg}{' swiglu' if swiglu else ''}{LABELS[wait]}"
                try:
                    plan = Plan(phases, vec, sms * cfg[0], *cfg[1:4])
                    launch = launcher(plan, cfg, [(0, plan.num_phases)], wait, outputs=outputs)
                    us = bench.graph_median_us(launch)
                    _fresh_run(plan, launch, outputs)
                    report(name, us, _worst([_rel(plan.vector(off, w.shape[0]), want)
                                             for off, w, want in zip(offs[1:], weights, wants)]))
                except Exception as e:  # noqa: BLE001 (reported, not fatal)
                    print(f"{name:52s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    # the ring alone: one product of every weight of the first K stacked (no barrier, one input)
    k0 = shapes[0][2]
    big = torch.cat([w for w in weights if w.shape[1] == k0])
    vec = Vectors()
    x_off, y_off = vec.add(x0.reshape(-1)[:k0]), vec.add(big.shape[0])
    want = (big.float() @ x0.reshape(-1)[:k0].float()).to(x0.dtype)
    for cfg in CONFIGS[:args.configs]:
        plan = Plan([(big, x_off, y_off, PLAIN, 0, 0, 0)], vec, sms * cfg[0], *cfg[1:4])
        us = bench.graph_median_us(launcher(plan, cfg, [(0, 1)]))
        tb_s = big.numel() * big.element_size() / us / 1e6
        report.rows.append({"model": args.model, "dtype": str(wdtype), "variant": f"stream {cfg}", "us": round(us, 2),
                            "tb_s": round(tb_s, 3), "rel_diff": _rel(plan.vector(y_off, big.shape[0]), want)})
        print(f"{'stream ' + str(cfg):52s} {us:8.1f} us  {tb_s:.2f} TB/s  rel {report.rows[-1]['rel_diff']:.2g}",
              flush=True)
    return report.rows


def run_block(args, bench, sms: int) -> list[dict]:
    """Per layer: o, then residual add + RMSNorm, gate|up, SwiGLU, down; one launch per layer against
    cuBLAS and the Hal's fused boundary ops."""
    from hal import registry

    shapes = dict((name, (n, k)) for name, n, k in bench.MODEL_SHAPES[args.model])
    (hidden, width), (two_i, _h), (_h2, inter) = shapes["o"], shapes["gate_up"], shapes["down"]
    eps = 1e-6
    layers = [dict(o=torch.randn(hidden, width, device="cuda", dtype=torch.bfloat16) / width ** 0.5,
                   gate_up=torch.randn(two_i, hidden, device="cuda", dtype=torch.bfloat16) / hidden ** 0.5,
                   down=torch.randn(hidden, inter, device="cuda", dtype=torch.bfloat16) / inter ** 0.5,
                   norm=1 + 0.1 * torch.randn(hidden, device="cuda", dtype=torch.bfloat16))
              for _ in range(args.layers)]
    attn = torch.randn(1, width, device="cuda", dtype=torch.bfloat16)
    resid = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    layer_bytes = (hidden * width + two_i * hidden + hidden * inter) * 2
    report = Report(args.model, torch.bfloat16, args.layers, layer_bytes)
    print(f"block: {args.model}, {args.layers} layers of o {hidden}x{width}, gate|up {two_i}x{hidden}, down "
          f"{hidden}x{inter}: {layer_bytes / 1e6:.1f} MB, floor {report.floor_us:.1f} us per layer", flush=True)

    hal = registry.get("cuda")
    norm_add_norm, silu_and_mul = hal.op("norm_add_norm"), hal.op("silu_and_mul")
    os.environ["LOOPSTACK_PDL"] = "1"
    outs = [dict(y1=torch.empty(1, hidden, device="cuda", dtype=torch.bfloat16),
                 y2=torch.empty(1, two_i, device="cuda", dtype=torch.bfloat16)) for _ in layers]
    result = {}

    def library():
        for lw, o in zip(layers, outs):
            torch.nn.functional.linear(attn, lw["o"], out=o["y1"])
            normed, h1 = norm_add_norm(o["y1"], resid, None, lw["norm"], eps)
            torch.nn.functional.linear(normed, lw["gate_up"], out=o["y2"])
            result["down"] = torch.nn.functional.linear(silu_and_mul(o["y2"]), lw["down"])
            result["h1"] = h1

    us = bench.graph_median_us(library)
    library()
    want_down, want_h1 = result["down"].reshape(-1).clone(), result["h1"].reshape(-1).clone()
    report("cublas + norm_add_norm + silu_and_mul (pdl)", us, 0.0)

    vec = Vectors()
    a_off, r_off = vec.add(attn), vec.add(resid)
    phases, outputs = [], []
    for lw in layers:
        y1, h1, y2, y3, nw = vec.add(hidden), vec.add(hidden), vec.add(two_i), vec.add(hidden), vec.add(lw["norm"])
        phases += [(lw["o"], a_off, y1, PLAIN, 0, 0, 0), (lw["gate_up"], y1, y2, ADD_NORM, r_off, nw, h1),
                   (lw["down"], y2, y3, SWIGLU, 0, 0, 0)]
        outputs += [(y1, hidden), (h1, hidden), (y2, two_i), (y3, hidden)]
    spans = [(3 * i, 3 * i + 3) for i in range(args.layers)]
    # call 5: four warps spill the staged vectors at Nanbeige's widths (255 registers, ~0.5 KiB of
    # stack): eight warps, and two-stage rings small enough (<= 113 KiB) that a launch's CTAs can sit
    # beside the previous launch's, so that PDL can start its first copies early
    for cfg in BLOCK_CONFIGS[:args.configs]:
        for pdl, wait in ((False, "barrier"), (True, "barrier"), (True, "sentinel"), (True, "sentinel-backoff"),
                          (True, "none")):
            name = f"tma block {cfg}{' pdl' if pdl else ''}{LABELS[wait]}"
            try:
                plan = Plan(phases, vec, sms * cfg[0], *cfg[1:4])
                launch = launcher(plan, cfg, spans, wait=wait, pdl=pdl, eps=eps, outputs=outputs)
                us = bench.graph_median_us(launch)
                _fresh_run(plan, launch, outputs)
                got_down = plan.vector(phases[-1][2], hidden)
                got_h1 = plan.vector(phases[-2][6], hidden)
                report(name, us, _worst([_rel(got_down, want_down), _rel(got_h1, want_h1)]))
            except Exception as e:  # noqa: BLE001 (reported, not fatal)
                print(f"{name:52s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    return report.rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("chain", "block", "compile"))
    p.add_argument("--model", default="ouro-1.4b")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--out", default=None)
    p.add_argument("--fp8", action="store_true", help="chain: e4m3 weights (unit scales: a bandwidth probe)")
    p.add_argument("--configs", type=int, default=None, help="only the first N configs of the mode")
    args = p.parse_args()
    if args.mode == "compile":
        return compile_only()
    torch.manual_seed(0)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import pdl_bench as bench                   # the chain's baselines and graph timer
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"torch {torch.__version__} triton {triton.__version__}", flush=True)
    rows = (run_chain if args.mode == "chain" else run_block)(args, bench, sms)
    append_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
