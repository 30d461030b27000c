"""Programmatic dependent launch (PDL) for the batch-1 projections: an experiment on the GPU.

    PYTHONPATH=. python tools/pdl_bench.py [--quick] [--model ouro-1.4b] [--layers 24] [--out rows.jsonl]
    PYTHONPATH=. python tools/pdl_bench.py --quick --ring --model ouro-1.4b    # the TMA ring beside them
    PYTHONPATH=. python tools/pdl_bench.py --fp8 [--ring] --model ouro-1.4b    # E4M3 weights: W8A16 slices, W8A8
                                                                            # slices (lever 118)[, the ring]
    PYTHONPATH=. python tools/pdl_bench.py --rows 64 [--shape o]     # decode batches: cuBLAS vs gemv.py's tl.dot path

Why: at batch 1 a decode step is a chain of about 7 launches per layer and loop, each paying its own
ramp (the first weight bytes) and tail (the last programs, the split-K reduction); inside a CUDA
graph the gaps between kernels are 0.15 us, so the loss is inside the kernels. With PDL a kernel
lets the next one start as soon as all its programs run (`gdc_launch_dependents`); the next one
loads its whole weight slice into registers, then waits for its input (`gdc_wait`). Weights never
depend on the previous kernel, so the weight stream can run ahead of the chain of products.

The chain: `layers` x (q|k|v, o, gate|up, down) at one model's shapes (Ouro-1.4B by default), each product reading its
input from the previous product's output (a true dependence), captured in one CUDA graph. Variants:
cuBLAS (`F.linear`), the whole-slice kernel (hal/kernels/gemv_slice.py) over a few tile shapes,
and (without `--quick`) the K-looping kernel of hal/kernels/gemv.py, each with and without PDL.
Prints us per layer, TB/s, and the largest difference to the non-PDL run of the same kernel (0: the
waits order the chain). The first run (2026-12-02, call 1) timed a standalone prototype of the
slice kernel instead; gemv_slice.py is what it became.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch
import triton
import triton.language as tl

from hal.kernels.configs import KernelConfig, configs_for
from hal.kernels.gemv_ops import SLICE_KEY
from runtime.bench_rows import append_rows

# (name, N, K) of a layer's four projections per model; each output is at least as wide as the next K
MODEL_SHAPES = {
    "ouro-1.4b": (("qkv", 3 * 2048, 2048), ("o", 2048, 2048), ("gate_up", 2 * 5632, 2048), ("down", 2048, 5632)),
    "huginn-0125": (("qkv", 3 * 5280, 5280), ("o", 5280, 5280), ("gate_up", 2 * 17920, 5280), ("down", 5280, 17920)),
    "nanbeige4.2-3b": (("qkv", 8192, 3072), ("o", 3072, 6144), ("gate_up", 2 * 10752, 3072), ("down", 3072, 10752)),
}
FLOOR_BANDWIDTH = 4.27e12
HAS_GDC = hasattr(tl.extra.cuda, "gdc_wait") if hasattr(tl, "extra") else False
ENV = "LOOPSTACK_PDL"


def cublas_launch(x, w, out):
    torch.nn.functional.linear(x, w, out=out)


def gemv_launcher(pdl: bool, config=None, preload: bool = False, rows: int = 1):
    """The Hal's decode GEMV kernel (hal/kernels/gemv.py) into the chain's buffers, PDL on or off
    (`preload`: the tl.dot path's first weight tile before the PDL wait)."""
    from hal.kernels.gemv import gemv_launch, plan
    from hal.kernels.launch import run_launch

    config = config or configs_for("sm_90")["gemv_m1"]
    units = torch.cuda.get_device_properties(0).multi_processor_count
    counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    workspace = torch.empty(64 * max(rows, 16) * 16384, dtype=torch.float32, device="cuda")

    def launch(x, w, out):
        os.environ[ENV] = "1" if pdl else "0"
        shaped = config
        if rows > 1 and config.split_k == 0:     # the wide plan (one wave of programs), preload or not
            shaped = dataclasses.replace(config, split_k=plan(rows, w.shape[0], w.shape[1], config, units,
                                                              wide=True).split_k)
        run_launch(gemv_launch(x, w, out, shaped, "cuda", units, workspace=workspace, counters=counters,
                               preload=preload))
    return launch


def slice_gemv_launcher(pdl: bool, config, scales: dict | None = None, a8: bool = False, tc: bool = False):
    """hal/kernels/gemv_slice.py (what the sm_90 table runs at one row) into the chain's buffers;
    `scales` (N -> float32 [N]): FP8 weights with a scale per output row; `a8`: x quantized too (W8A8
    on the tensor cores, lever 118); `tc`: 16-bit weights on the tensor cores (lever 119)."""
    from hal.kernels.gemv_slice import slice_gemv_launch
    from hal.kernels.launch import run_launch

    counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    workspace = torch.empty(64 * 16384, dtype=torch.float32, device="cuda")

    def launch(x, w, out):
        os.environ[ENV] = "1" if pdl else "0"
        run_launch(slice_gemv_launch(x, w, out, config, "cuda", workspace=workspace, counters=counters,
                                     weight_scale=scales[w.shape[0]] if scales is not None else None, a8=a8,
                                     tensor_cores=tc))
    return launch


RING_CONFIGS = ((1, 8, 256, 4, 6, 4), (1, 8, 256, 2, 8, 4), (1, 16, 256, 2, 6, 4), (1, 16, 256, 4, 4, 8),
                (1, 8, 256, 4, 4, 4), (2, 8, 256, 2, 6, 4), (2, 8, 256, 4, 3, 4))
# hal/cuda/ring_gemv.RingConfig: programs_per_sm, block_n, block_k, boxes, stages, num_warps


FP8_RING_CONFIGS = ((1, 16, 256, 4, 4, 8, True), (1, 16, 256, 4, 4, 8, False), (1, 16, 256, 4, 6, 4, True),
                    (1, 16, 256, 4, 6, 4, False), (2, 16, 256, 2, 4, 4, True), (1, 32, 256, 2, 4, 4, True),
                    (2, 8, 256, 4, 4, 4, True))
# the same fields, then `bits`: e4m3 widened by integer ops (True) or by cvt instructions (False)


# lever 118: W8A8 one-row slices on the FP8 tensor cores (wgmma needs 64 rows a warpgroup): block_n, block_k, warps
W8A8_SLICE_CONFIGS = ((64, 512, 4), (64, 1024, 4), (64, 256, 4), (128, 256, 4), (128, 512, 8), (64, 2048, 4),
                      (64, 512, 8), (128, 128, 4))


# lever 119: 16-bit one-row slices on the tensor cores, staged in shared memory before the wait
TC_SLICE_CONFIGS = ((64, 512, 4), (64, 256, 4), (128, 256, 4), (64, 1024, 4), (128, 512, 8), (64, 512, 8),
                    (128, 128, 4))


def ring_launcher(config, scales: dict | None = None, bits: bool = True):
    """hal/cuda/ring_gemv.py (lever 114: the TMA ring, with PDL) into the chain's buffers; `scales` (N ->
    float32 [N]): FP8 weights with a scale per output row."""
    from hal.cuda import ring_gemv

    config = ring_gemv.RingConfig(*config)

    def launch(x, w, out):
        ring_gemv.ring_linear(x, w, config, pdl=True, out=out, bits=bits,
                              scale=scales[w.shape[0]] if scales is not None else None)
    return launch


def fp8_weights(weights: list) -> tuple[list, dict]:
    """E4M3 copies of `weights` with one float32 scale per output row and N (every layer of a shape
    shares its first layer's scales, as the launchers look them up by N)."""
    scales, out = {}, []
    for w in weights:
        n = w.shape[0]
        if n not in scales:
            scales[n] = (w.float().abs().amax(dim=1) / 448.0).clamp(min=1e-12)
        out.append((w.float() / scales[n][:, None]).clamp(-448, 448).to(torch.float8_e4m3fn))
    return out, scales


def chain(launch, weights, bufs, x0, independent: bool = False):
    """Every product reads the previous product's output (its first K values); `independent`: each
    reads x0 (one shape repeated, whose output is narrower than its input)."""
    prev = x0
    for w, out in zip(weights, bufs):
        launch((x0 if independent else prev)[..., :w.shape[1]], w, out)
        prev = out


def time_graph(launch, weights, x0, replays: int = 20, independent: bool = False):
    bufs = [torch.empty(x0.shape[0], w.shape[0], dtype=w.dtype, device="cuda") for w in weights]
    us = graph_median_us(lambda: chain(launch, weights, bufs, x0, independent), replays)
    return us, bufs[-1].float().clone()


def graph_median_us(fn, replays: int = 20) -> float:
    """Median us of one replay of `fn` captured in a CUDA graph (two warm-up runs on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times.sort()
    return times[len(times) // 2]


ROWS_CONFIGS = ((128, 64, 8, 3, 0), (128, 64, 8, 4, 0), (64, 64, 4, 4, 0), (64, 64, 4, 3, 0), (128, 64, 4, 3, 0),
                (128, 128, 8, 2, 0), (256, 64, 8, 3, 0), (64, 128, 4, 4, 0))
# (block_n, block_k, warps, stages, split_k; 0: gemv.plan's wide rule, one wave of programs)


def rows_variants(rows: int) -> list:
    """gemv.py's tl.dot path at decode-batch rows: each config with PDL, and with the first weight
    tile loaded before the wait (the first config also without PDL)."""
    out = []
    for i, (bn, bk, warps, stages, split) in enumerate(ROWS_CONFIGS):
        config = KernelConfig(16, bn, warps, stages, block_k=bk, split_k=split)
        for pdl, preload in ((False, False), (True, False), (True, True))[0 if i == 0 else 1:]:
            label = f"gemv n{bn} k{bk} w{warps} s{stages} sk{split}{' pdl' if pdl else ''}{' preload' if preload else ''}"
            out.append((label, gemv_launcher(pdl, config, preload, rows)))
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODEL_SHAPES), default="ouro-1.4b",
                   help="whose projection shapes (Huginn and Nanbeige: K in several slices, lever 38)")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true", help="cuBLAS and the slice kernel's configs only")
    p.add_argument("--rows", type=int, default=1, help="rows of x: above 1, cuBLAS against gemv.py's tl.dot path")
    p.add_argument("--ring", action="store_true", help="also the TMA ring's configs (hal/cuda/ring_gemv.py, sm_90)")
    p.add_argument("--fp8", action="store_true", help="E4M3 weights (scale per row): the FP8 slice kernel (the "
                   "engine's) against W8A8 slice configs (lever 118), and with --ring the ring's FP8 configs")
    p.add_argument("--shape", default=None, help="one projection repeated (each reads the same x) instead of the chain")
    args = p.parse_args()
    torch.manual_seed(0)
    shapes = MODEL_SHAPES[args.model]
    if args.shape:
        shapes = tuple(s for s in shapes if s[0] == args.shape)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
               for _ in range(args.layers) for _, n, k in shapes]
    x0 = torch.randn(args.rows, max(k for _, _, k in shapes), device="cuda", dtype=torch.bfloat16)
    layer_bytes = sum(n * k * 2 for _, n, k in shapes) // (2 if args.fp8 else 1)
    floor_us = layer_bytes / FLOOR_BANDWIDTH * 1e6
    print(f"torch {torch.__version__} triton {triton.__version__} gdc {HAS_GDC}; per layer {layer_bytes / 1e6:.1f} MB, "
          f"floor {floor_us:.1f} us", flush=True)
    variants = [("cublas", cublas_launch)]
    if args.fp8:    # no library product at one row: the engine's slice kernel is the reference ("rel-to-cublas")
        weights, scales = fp8_weights(weights)
        engine_config = configs_for("sm_90")[SLICE_KEY]
        variants = [("gemv_slice fp8 (sm_90 table) pdl", slice_gemv_launcher(True, engine_config, scales))]
        variants += [(f"w8a8 slice bn{bn} bk{bk} w{warps} pdl",
                      slice_gemv_launcher(True, KernelConfig(1, bn, warps, 1, block_k=bk), scales, a8=True))
                     for bn, bk, warps in W8A8_SLICE_CONFIGS]
        if args.ring:
            variants += [(f"ring fp8 {c[:4]} s{c[4]} w{c[5]} {'bits' if c[6] else 'cvt'} pdl",
                          ring_launcher(c[:6], scales, c[6])) for c in FP8_RING_CONFIGS]
    bf16_rows = 0 if args.fp8 else args.rows        # the bf16 variants below: none with --fp8
    if bf16_rows > 1:
        variants += rows_variants(args.rows)
    if bf16_rows == 1:      # ahead of the slice sweep, so that a run cut short keeps them
        variants += [(f"tc slice bn{bn} bk{bk} w{warps} pdl",
                      slice_gemv_launcher(True, KernelConfig(1, bn, warps, 1, block_k=bk), tc=True))
                     for bn, bk, warps in TC_SLICE_CONFIGS]
    for bn, bk, warps in () if bf16_rows != 1 else ((4, 2048, 4), (2, 2048, 2), (4, 2048, 2), (8, 2048, 4), (8, 2048, 8), (4, 4096, 4),
                          (4, 4096, 8), (2, 4096, 4), (16, 1024, 4), (8, 1024, 2)):
        for pdl in (False, True):
            variants.append((f"gemv_slice bn{bn} bk{bk} w{warps}{' pdl' if pdl else ''}",
                             slice_gemv_launcher(pdl, KernelConfig(1, bn, warps, 1, block_k=bk))))
    if args.ring and bf16_rows == 1:
        variants += [(f"ring {c[:4]} s{c[4]} w{c[5]} pdl", ring_launcher(c)) for c in RING_CONFIGS]
    if not args.quick and bf16_rows == 1:   # the K-looping kernel, in its table config and with one tile per split
        for label, config in (("sm_90 config", None),
                              ("bn16 bk512 one tile/split", KernelConfig(1, 16, 4, 2, block_k=512, split_k=16)),
                              ("bn8 bk1024 one tile/split", KernelConfig(1, 8, 4, 2, block_k=1024, split_k=16)),
                              ("bn16 bk256 one tile/split", KernelConfig(1, 16, 4, 2, block_k=256, split_k=16)),
                              ("bn32 bk256 split auto", KernelConfig(1, 32, 4, 2, block_k=256, split_k=0))):
            for pdl in (False, True):
                variants.append((f"gemv {label}{' pdl' if pdl else ''}", gemv_launcher(pdl, config)))
    rows, ref = [], {}
    for name, launch in variants:
        try:
            us, y = time_graph(launch, weights, x0, independent=bool(args.shape))
        except Exception as e:  # noqa: BLE001 (a variant that fails to compile or capture is reported, not fatal)
            print(f"{name:34s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        base = name.replace(" pdl", "").replace(" preload", "")
        diff = float((y - ref[base]).abs().max()) if base in ref else 0.0
        ref.setdefault(base, y)
        ref.setdefault("cublas", y)
        rel = float((y.float() - ref["cublas"].float()).norm() / ref["cublas"].float().norm())
        per_layer = us / args.layers
        row = {"model": args.model, "rows": args.rows, "fp8": args.fp8, "shape": args.shape or "chain", "variant": name, "us_per_layer": round(per_layer, 2), "tb_s": round(layer_bytes / per_layer / 1e6, 3),
               "floor_ratio": round(floor_us / per_layer, 3), "max_diff_vs_no_pdl": diff,
               "rel_diff_vs_cublas": rel}
        rows.append(row)
        append_rows(args.out, [row])  # row by row: a run cut short by its time limit keeps what it measured
        print(f"{name:34s} {per_layer:7.2f} us/layer  {row['tb_s']:.2f} TB/s  {row['floor_ratio']:.2f} of floor  "
              f"diff {diff:.3g}  rel-to-cublas {rel:.2g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
