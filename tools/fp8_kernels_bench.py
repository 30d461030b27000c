"""GPU timings of the FP8 kernels against their bf16 twins at the Ouro-1.4B shapes (issue 20).

    PYTHONPATH=. python tools/fp8_kernels_bench.py [--budget 120] [--out fp8_kernels.jsonl]

1. Decode attention, one layer-plane per call (batch x context as the bench cells): the bf16 unified
   kernel, and the FP8 cache through it in its table's config (`attention_decode_fp8`) and a sweep of
   tile configs; the row-stream decode kernel (hal/kernels/row_decode.py) in a sweep of its own. Bytes: the K/V values and scales the step must read (bf16 reads 2 bytes per value).
2. Projections at 1 and 8 rows: cuBLAS bf16, the W8A16 decode GEMV (hal/kernels/gemv.py) in its
   default and a wider-K config, `torch._scaled_mm` W8A8 with the one-launch activation quantization,
   and the older W8A16 tile kernel (hal/kernels/fp8_linear.py).
Every cell is a CUDA graph of calls over enough distinct planes / weight copies to stream from HBM
(several times the L2); one line each, as tools/decode_kernels_bench.py prints them.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import astuple, replace
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_kernels_bench import FLOOR_BANDWIDTH, HEADER, L2_BYTES, SHAPES, Bench, _randn, _rel_err  # noqa: E402

from hal.attention import PagedBatch  # noqa: E402
from hal.common.kv_quant import scale_dtype  # noqa: E402
from hal.kernels.configs import KernelConfig, configs_for  # noqa: E402
from hal.kernels.splits import num_kv_splits  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 16, 128, 16
ATTENTION_CELLS = ((1, 1024), (64, 1024), (128, 1024))                     # (batch, context)
UNIFIED_SWEEP = {                  # decode tile configs tried beside each table config, per cache dtype
    # (the runners-up of the wider sweeps of 2026-12-02, docs/performance.md levers 22 and 24)
    "bf16": [KernelConfig(16, n, w, st) for n, w, st in ((32, 4, 4), (64, 4, 3))],
    "fp8": [KernelConfig(16, n, w, st) for n, w, st in ((64, 4, 3), (128, 4, 3))],
}
ROW_SWEEP = {                      # row-stream decode kernel (hal/kernels/row_decode.py) configs, per cache dtype
    # (the first also runs at twice the splits and with the eager rescale; 3 stages ran at half the speed
    # of 2 on 2026-12-02; several heads per program at 1.5-2x the time, lever 43)
    # the sm_90 table's config first; 3-4 stages read each tile's pages in its own iteration (lever 44)
    "bf16": [KernelConfig(1, n, w, st) for n, w, st in ((16, 2, 3), (32, 4, 3), (32, 4, 2), (16, 1, 4))],
    "fp8": [KernelConfig(1, n, w, st) for n, w, st in ((8, 1, 4), (8, 1, 3), (16, 2, 3), (16, 2, 4), (32, 4, 3),
                                                      (16, 2, 2), (8, 1, 6), (16, 1, 3), (16, 1, 4), (16, 4, 3))],
}
FP8 = torch.float8_e4m3fn


def _paged(device, num_seqs: int, seq_len: int, num_planes: int, kv_dtype, heads: int = HEADS,
           head_dim: int = HEAD_DIM):
    from hal.common.kv_quant import encode_scales, power_of_two_at_least
    from hal.kernels.backend import TritonPagedAttention

    blocks_per_seq = -(-seq_len // PAGE)
    num_blocks = num_seqs * blocks_per_seq * num_planes
    pool = list(range(num_blocks))
    random.Random(0).shuffle(pool)
    tables = [[[pool.pop() for _ in range(blocks_per_seq)] for _ in range(num_seqs)] for _ in range(num_planes)]
    batch = PagedBatch([1] * num_seqs, [seq_len] * num_seqs, tables, PAGE)
    backend = TritonPagedAttention(heads, heads, head_dim, torch.bfloat16, device, PAGE, kv_dtype=kv_dtype)
    cache = torch.empty(backend.kv_cache_shape(num_blocks), dtype=backend.kv_cache_dtype, device=device)
    if kv_dtype is None:
        cache.normal_()
    else:                                    # random FP8 values (never NaN) and positive scales
        layout = backend.kv_layout
        layout.values(cache).copy_(torch.randn(layout.values(cache).shape, device=device).to(kv_dtype))
        scales = power_of_two_at_least(torch.rand(layout.scales(cache).shape, device=device) * 0.1 + 0.01)
        layout.scales(cache).copy_(encode_scales(scales, kv_dtype))
    q = torch.randn(num_seqs, heads, head_dim, dtype=torch.bfloat16, device=device)
    return backend, batch, cache, q


def _reference(backend, batch, cache, q, plane: int) -> torch.Tensor:
    from hal.common.torch_attention import TorchPagedAttention

    kv = {"kv_dtype": backend.kv_dtype} if backend.kv_layout is not None else {}
    ref = TorchPagedAttention(HEADS, KV_HEADS, HEAD_DIM, torch.float32, q.device, PAGE, **kv)
    return ref.forward(q.float(), cache if backend.kv_layout is not None else cache.float(),
                       ref.build_meta(batch), plane, HEAD_DIM ** -0.5)


def _eager_rescale(build):
    """`build` with the row kernel's lazy rescale off: every tile rescales its streams (lever 43)."""
    return lambda *args: [launch._replace(kwargs={**launch.kwargs, "LAZY": False})
                          if "LAZY" in launch.kernel.arg_names else launch for launch in build(*args)]


def _attend(build, q, values, scales, meta, plane: int, scale: float, config, num_splits: int, reduce_config,
            out: torch.Tensor) -> torch.Tensor:
    """One decode attention call on `plane` through `build` (the unified or the row kernel's launches)."""
    from hal.kernels.launch import run_launch

    for launch in build(q, values, meta.block_tables[plane], meta.seq_lens, meta.query_start_loc, scale, config,
                        num_splits, reduce_config, out, "cuda", scales):
        run_launch(launch)
    return out


def _scales_once(build):
    """`build` with the scale tensor's block and slot strides at 0 (lever 49's diagnostic): the loads
    and instructions stay, the scale reads all hit one cache line."""
    def wrapped(*args):
        scales = args[-1]
        return build(*args[:-1], scales.as_strided(scales.shape, (scales.stride(0), 0, 0, scales.stride(3))))
    return wrapped


def attention_cells(bench: Bench, rows_only: bool = False) -> None:
    """Decode attention per layer-plane; `rows_only`: batch 64 and 128, the table configs and the row
    kernel's sweep only."""
    from hal.kernels import attention
    from hal.kernels.row_decode import row_decode_launches

    scale = HEAD_DIM ** -0.5
    units = bench.device_units
    for num_seqs, context in ATTENTION_CELLS[1:] if rows_only else ATTENTION_CELLS:
        seq_len = context + 1
        for kv_dtype in (None, FP8):
            value_bytes = 2 if kv_dtype is None else 1
            scale_bytes = 0 if kv_dtype is None else scale_dtype(kv_dtype).itemsize
            plane_bytes = num_seqs * seq_len * 2 * KV_HEADS * (HEAD_DIM * value_bytes + scale_bytes)
            num_planes = max(2, min(96, math.ceil(4 * L2_BYTES / plane_bytes)))
            backend, batch, cache, q = _paged(bench.device, num_seqs, seq_len, num_planes, kv_dtype)
            meta = backend.build_meta(batch)
            values, scales = backend._views(cache)
            splits = num_kv_splits(num_seqs, KV_HEADS, units)
            shape = f"B{num_seqs}xK{context}"
            ref = _reference(backend, batch, cache, q, 0)
            out = torch.empty_like(q)
            configs = backend.configs

            default = configs["attention_decode" if kv_dtype is None else "attention_decode_fp8"]

            def attend(plane, config=default, num_splits=splits, build=attention.attention_launches):
                return _attend(build, q, values, scales, meta, plane, scale, config, num_splits,
                               configs["attention_reduce"], out)

            def check(fn):
                return lambda: _rel_err(fn(0), ref)

            name = "bf16" if kv_dtype is None else "fp8"
            bench.cell("attn", shape, num_seqs, f"{name} unified (table config)",
                       lambda: [lambda p=p: attend(p) for p in range(num_planes)], plane_bytes, check(attend))
            rows = [(config, splits, "rows") for config in ROW_SWEEP[name]]
            if num_seqs == 1:
                rows = rows[:2]
            variants = rows if num_seqs == 1 else (
                # the table config's other fields (heads_first) ride along with each swept tile
                [(replace(default, block_n=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages), splits,
                  "unified") for c in UNIFIED_SWEEP[name]] + [(default, 2 * splits, "unified")]
                + rows + [(rows[0][0], 2 * splits, "rows"), (rows[0][0], splits, "rows eager")]
                + ([(rows[0][0], splits, "rows scales-once")] if kv_dtype is not None else []))
            if rows_only:
                variants = [v for v in variants if v[2].startswith("rows")]
            for config, num_splits, kind in variants:
                build = row_decode_launches if kind.startswith("rows") else attention.attention_launches
                if kind == "rows eager":
                    build = _eager_rescale(build)
                if kind == "rows scales-once":       # a diagnostic: every key reads one slot's scales (wrong
                    build = _scales_once(build)       # values, the same instructions, no scale traffic)
                fn = lambda plane, c=config, n=num_splits, b=build: attend(plane, c, n, b)   # noqa: E731
                bench.cell("attn", shape, num_seqs, f"{name} {kind.split()[0]} n{config.block_n} w{config.num_warps} "
                           f"s{config.num_stages} x{num_splits}" + ("" if kind in ("rows", "unified") else
                                                                    " " + kind.split()[1]),
                           lambda fn=fn: [lambda p=p: fn(p) for p in range(num_planes)], plane_bytes, check(fn))
            del backend, cache, meta
            torch.cuda.empty_cache()


LAYOUT_CASES = (    # (label, cache dtype, heads, head dim, sequences) at 1K context, the row kernel's table config
    ("fp8 16 heads D128 (Ouro-1.4B)", FP8, 16, 128, 128),
    ("fp8 1 head D128 x16 seqs", FP8, 1, 128, 2048),
    ("bf16 16 heads D128 (Ouro-1.4B)", None, 16, 128, 128),
    ("bf16 16 heads D64", None, 16, 64, 128),
    ("bf16 1 head D128 x16 seqs", None, 1, 128, 2048),
)


def layout_cells(bench: Bench, context: int = 1024) -> None:
    """Lever 49's diagnostic: the row kernel over the same bytes laid out otherwise. One KV head makes
    a program's keys nearly contiguous (a slot's values are 128 bytes apart, not 2,048); bf16 at head
    dim 64 reads 128 bytes per key and head, as FP8 at 128 does, without FP8's conversions."""
    from hal.kernels.row_decode import row_decode_launches

    for label, kv_dtype, heads, head_dim, num_seqs in LAYOUT_CASES:
        seq_len = context + 1
        value_bytes, scale_bytes = (2, 0) if kv_dtype is None else (1, scale_dtype(kv_dtype).itemsize)
        plane_bytes = num_seqs * seq_len * 2 * heads * (head_dim * value_bytes + scale_bytes)
        num_planes = max(2, min(96, math.ceil(4 * L2_BYTES / plane_bytes)))
        backend, batch, cache, q = _paged(bench.device, num_seqs, seq_len, num_planes, kv_dtype, heads, head_dim)
        meta = backend.build_meta(batch)
        values, scales = backend._views(cache)
        configs = backend.configs
        config = configs_for("sm_90")["attention_row_decode" + ("" if kv_dtype is None else "_fp8")]
        splits = num_kv_splits(num_seqs, heads, bench.device_units)
        out = torch.empty_like(q)

        def attend(plane, values=values, scales=scales, meta=meta, q=q, out=out, config=config, splits=splits):
            return _attend(row_decode_launches, q, values, scales, meta, plane, head_dim ** -0.5, config, splits,
                           configs["attention_reduce"], out)

        bench.cell("layout", f"{num_seqs}x{context}", num_seqs, f"{label} x{splits}",
                   lambda attend=attend, n=num_planes: [lambda p=p: attend(p) for p in range(n)], plane_bytes)
        del backend, cache, meta
        torch.cuda.empty_cache()


def write_cells(bench: Bench) -> None:
    """The decode step's K/V write at 1 and 128 tokens: rotary + write in one launch (16-bit cache,
    8-bit cache) against rotary then the quantizing write (two launches)."""
    from hal.kernels.configs import configs_for
    from hal.kernels.kv_write import write_kv
    from hal.kernels.ops import rotary
    from hal.kernels.rotary_kv import rotary_kv_write

    configs = configs_for("sm_90")
    for tokens in (1, 128):
        caches = {kv: _paged(bench.device, tokens, 64, 96, kv)[:3] for kv in (None, FP8)}
        qkv = torch.randn(tokens, 3 * HEADS, HEAD_DIM, dtype=torch.bfloat16, device=bench.device)
        q, k, v = qkv[:, :HEADS], qkv[:, HEADS:2 * HEADS], qkv[:, 2 * HEADS:]
        positions = torch.arange(tokens, device=bench.device) + 40
        for kv, (backend, batch, cache) in caches.items():
            meta = backend.build_meta(batch)
            values, scales = backend._views(cache)
            slots = [meta.slot_mapping[p] for p in range(96)]
            label = "bf16" if kv is None else "fp8"
            bench.cell("write", f"T{tokens}", tokens, f"{label} rotary+write one launch", lambda: [
                lambda s=s: rotary_kv_write(q, k, v, positions, 1e4, False, values, s, configs["rotary"],
                                            kv_scales=scales)
                for s in slots], 0.0)
            bench.cell("write", f"T{tokens}", tokens, f"{label} rotary, then write", lambda: [
                lambda s=s: write_kv(rotary(q, k, positions, 1e4, False, configs)[1], v, values, s,
                                     configs["kv_write"], scales) for s in slots], 0.0)
        del caches
        torch.cuda.empty_cache()


def projection_cells(bench: Bench) -> None:
    import torch.nn.functional as F

    from hal.common.kv_quant import quantize
    from hal.cuda.fp8 import scaled_mm_linear
    from hal.kernels import fp8_linear as w8a16, fp8_rows
    from hal.kernels.gemv_ops import Gemv

    configs = configs_for("sm_90")
    gemv = Gemv(configs, bench.device_units)
    wide = Gemv({**configs, "gemv_m1": KernelConfig(1, 16, 4, 2, block_k=512, split_k=0)}, bench.device_units)
    quantize_rows = lambda x: fp8_rows.quantize_rows(x, FP8, configs["rms_norm"])   # noqa: E731
    for name, (n, k) in SHAPES.items():
        if name == "lm_head":
            continue
        copies = max(2, min(48, math.ceil(4 * L2_BYTES / (n * k))))
        bf16 = [torch.randn(n, k, device=bench.device, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
        fp8 = [quantize(w.float(), FP8) for w in bf16]
        for m in (1, 8):
            xs = [_randn(m, k, device=bench.device) for _ in range(copies)]
            io = 2 * m * (k + n)
            ref = xs[0].float() @ bf16[0].float().T
            bench.cell("proj", name, m, "cublas bf16",
                       lambda xs=xs: [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, bf16)], 2 * n * k + io)
            fp8_bytes = n * k + 4 * n + io
            variants = [("gemv W8A16", gemv.fp8_linear), ("scaled_mm W8A8", lambda x, w, s: scaled_mm_linear(
                x, w, s, None, quantize_rows)), ("tile kernel W8A16", lambda x, w, s: w8a16.fp8_linear(
                    x, w, s, None, configs["fp8_linear"]))]
            if m == 1:
                variants.insert(1, ("gemv W8A16 block_k 512", wide.fp8_linear))
            for label, fn in variants:
                bench.cell("proj", name, m, label,
                           lambda xs=xs, fn=fn: [lambda x=x, ws=ws, fn=fn: fn(x, *ws) for x, ws in zip(xs, fp8)],
                           fp8_bytes, lambda fn=fn, xs=xs: _rel_err(fn(xs[0], *fp8[0]), ref))
        del bf16, fp8
        torch.cuda.empty_cache()


PROMPT_ROWS = (32, 128, 512, 1024)
# lever 134 (probe): the tile kernel on rows already quantized (FP8 x FP8 on the tensor cores), small tiles for
# many programs at 128-1,024 rows (cuBLAS's 128 x 128 tiles give the 2,048-wide o and down 16 at 128 rows)
W8A8_TILES = [KernelConfig(bm, bn, w, st, block_k=bk) for bm, bn, w, st, bk in (
    (64, 64, 4, 4, 128), (64, 32, 4, 4, 128), (32, 64, 4, 4, 128), (64, 128, 4, 3, 128), (128, 64, 8, 3, 128),
    (64, 64, 4, 3, 256), (128, 128, 8, 3, 128))]
# lever 139: the leaders at 128 rows with K split (0: until every SM has a program; 2 and 4 fixed)
W8A8_SPLIT_TILES = [KernelConfig(bm, bn, w, st, block_k=bk, split_k=sk) for bm, bn, w, st, bk, sk in (
    (64, 64, 4, 4, 128, 0), (64, 64, 4, 4, 128, 2), (64, 64, 4, 4, 128, 4), (64, 32, 4, 4, 128, 0),
    (64, 64, 4, 3, 256, 0), (128, 64, 8, 3, 128, 0), (32, 64, 4, 4, 128, 0))]
TILE_KEY = "fp8_linear_w8a8"
BY_GRID = "tile W8A8 table + deep by grid"      # lever 140's rule (fp8_linear.w8a8_config), its sum per M


def _tile_label(c: KernelConfig, form: str) -> str:
    split = "" if c.split_k == 1 else f" sk{c.split_k or 'auto'}"
    return f"tile {form} {c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages} k{c.block_k}{split}"


def prompt_sums(rows: list) -> dict[tuple[int, str], float]:
    """Prints and returns each variant's sum over Ouro-1.4B's four products per M (a layer-loop's)."""
    sums: dict[tuple[int, str], list[float]] = {}
    for r in rows:
        if r.group == "prompt" and r.us is not None:
            sums.setdefault((r.rows, r.variant), []).append(r.us)
    whole = {key: sum(us) for key, us in sums.items() if len(us) == len(SHAPES) - 1}     # lm_head is not timed
    for (m, variant), us in sorted(whole.items()):
        print(f"prompt   sum        {m:>4} {variant:34} {us:8.2f}")
    return whole


def best_tile(sums: dict[tuple[int, str], float], num_rows: int) -> KernelConfig | None:
    """The W8A8 tile config with the least sum at `num_rows`, if it beats `_scaled_mm` on the same rows."""
    tiles = {_tile_label(c, "W8A8"): c for c in W8A8_TILES + W8A8_SPLIT_TILES}
    timed = [(us, tiles[v]) for (m, v), us in sums.items() if m == num_rows and v in tiles]
    library = sums.get((num_rows, "scaled_mm on rows"))
    if not timed or library is None:
        return None
    us, config = min(timed, key=lambda t: t[0])
    return config if us < library else None


def prompt_projection_cells(bench: Bench, row_counts: tuple[int, ...] = PROMPT_ROWS) -> None:
    """Lever 129: a prompt's FP8 products (32-1,024 rows) on `torch._scaled_mm` with its quantization launch
    (the engine's path past the decode rows) beside cuBLAS bf16 (lever 129's W8A16 tiles lost and left this
    run: their rows are docs/data/h100-s53-call5-fp8-prompt.jsonl). Lever 134: the products alone on rows already
    quantized (as lever 132's boundaries hand q|k|v and gate|up theirs), `_scaled_mm` against the tile
    kernel's W8A8 form in `W8A8_TILES`; lever 139: with K split (`W8A8_SPLIT_TILES`)."""
    for name, (n, k) in SHAPES.items():
        if name != "lm_head":
            _prompt_shape_cells(bench, name, n, k, row_counts)     # its weight copies are freed on return
            torch.cuda.empty_cache()


def _prompt_shape_cells(bench: Bench, name: str, n: int, k: int, row_counts: tuple[int, ...]) -> None:
    import torch.nn.functional as F

    from hal.common.kv_quant import quantize
    from hal.common.quantized_rows import QuantizedRows
    from hal.cuda.fp8 import scaled_mm_linear, scaled_mm_rows
    from hal.kernels import fp8_linear as w8a16, fp8_rows
    from hal.kernels.configs import W8A8_DEEP_CANDIDATE

    def quantize_rows(x):
        return fp8_rows.quantize_rows(x, FP8, configs_for("sm_90")["rms_norm"])

    copies = max(2, min(48, math.ceil(4 * L2_BYTES / (n * k))))
    bf16 = [torch.randn(n, k, device=bench.device, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    fp8 = [quantize(w.float(), FP8) for w in bf16]
    variants = [("scaled_mm W8A8", lambda x, w, s: scaled_mm_linear(x, w, s, None, quantize_rows))]
    for m in row_counts:
        xs = [_randn(m, k, device=bench.device) for _ in range(copies)]
        io = 2 * m * (k + n)
        ref = xs[0].float() @ bf16[0].float().T
        bench.cell("prompt", name, m, "cublas bf16",
                   lambda xs=xs: [lambda x=x, w=w: F.linear(x, w) for x, w in zip(xs, bf16)], 2 * n * k + io)
        for label, fn in variants:
            bench.cell("prompt", name, m, label,
                       lambda xs=xs, fn=fn: [lambda x=x, ws=ws, fn=fn: fn(x, *ws) for x, ws in zip(xs, fp8)],
                       n * k + 4 * n + io, lambda fn=fn, xs=xs, ref=ref: _rel_err(fn(xs[0], *fp8[0]), ref))
        rows = [QuantizedRows(*quantize_rows(x), x.dtype) for x in xs]           # quantized before the timing
        on_rows = [("scaled_mm on rows", scaled_mm_rows)]
        on_rows += [(_tile_label(c, "W8A8"), lambda r, w, s, c=c: w8a16.fp8_linear(r, w, s, None, c))
                    for c in W8A8_TILES + W8A8_SPLIT_TILES]
        # lever 140: the sm_90 table's entry, or the deep candidate where this product's tiles fit two an SM
        table = configs_for("sm_90")[TILE_KEY]
        by_grid = w8a16.w8a8_config(m, n, table, W8A8_DEEP_CANDIDATE, bench.device_units)
        on_rows.append((BY_GRID, lambda r, w, s, c=by_grid: w8a16.fp8_linear(r, w, s, None, c)))
        for label, fn in on_rows:
            bench.cell("prompt", name, m, label,
                       lambda rows=rows, fn=fn: [lambda r=r, ws=ws, fn=fn: fn(r, *ws) for r, ws in zip(rows, fp8)],
                       n * k + 4 * n + m * k + 2 * m * n,
                       lambda fn=fn, rows=rows, ref=ref: _rel_err(fn(rows[0], *fp8[0]), ref))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=120.0, help="seconds; later cells are skipped")
    parser.add_argument("--out", default=None, help="JSON lines of every cell")
    parser.add_argument("--only", choices=("attn", "attnrows", "write", "proj", "layout", "prompt"), default=None,
                        help="one group of cells (attnrows: the row kernel's sweep at batch 64 and 128; "
                             "layout: lever 49's cache-layout diagnostic; prompt: levers 129 and 134's prompt-sized "
                             "FP8 products, not part of the default run)")
    parser.add_argument("--prompt-rows", default=None, help="prompt: the row counts, e.g. 32,128 (default: "
                        + ",".join(map(str, PROMPT_ROWS)) + ")")
    parser.add_argument("--env-out", default=None,
                        help="prompt: write the W8A8 tile config with the least sum at the largest row count "
                             "(if it beats _scaled_mm there) as LOOPSTACK_KERNEL_CONFIGS JSON")
    args = parser.parse_args(argv)
    from hal.kernels.backend import device_compute_units

    device = torch.device("cuda")
    bench = Bench(device, time.monotonic() + args.budget, device_units=device_compute_units(device))
    print(f"floor bandwidth {FLOOR_BANDWIDTH / 1e12:.2f} TB/s; {bench.device_units} SMs")
    print(HEADER)
    if args.only == "attnrows":
        attention_cells(bench, rows_only=True)
    if args.only == "layout":
        layout_cells(bench)
    if args.only == "prompt":
        row_counts = tuple(int(m) for m in args.prompt_rows.split(",")) if args.prompt_rows else PROMPT_ROWS
        prompt_projection_cells(bench, row_counts)
        best = best_tile(prompt_sums(bench.rows), max(row_counts))
        print(f"best W8A8 tile at {max(row_counts)} rows: {best}")
        if args.env_out and best is not None:
            Path(args.env_out).write_text(json.dumps({TILE_KEY: list(astuple(best))}) + "\n")
    for group, cells in (("attn", attention_cells), ("write", write_cells), ("proj", projection_cells)):
        if args.only in (None, group):
            cells(bench)
    if bench.skipped:
        print(f"skipped (budget): {len(bench.skipped)} cells: {', '.join(bench.skipped[:8])}")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r.__dict__) + "\n" for r in bench.rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
