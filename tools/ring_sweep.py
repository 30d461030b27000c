"""Lever 114's configs against the library (written in the forty-sixth session, not yet run on a GPU), one one-row product shape at a time (docs/performance.md):
each config of the TMA ring (hal/cuda/ring_gemv.py) and the product the CUDA Hal would otherwise run
(cuBLASLt's table or F.linear), timed in a CUDA graph over enough weight copies to defeat L2, the ring's
launches chained by PDL as in the engine.

    PYTHONPATH=.:tools python tools/ring_sweep.py [--models nanbeige4.2-3b,huginn-0125] [--out rows.jsonl]
        [--env-out ring.json]

Prints us per call, TB/s and the ratio to the library per shape and config; the best config per shape
is what `ring_gemv.TABLE` should name where it beats the library (sm_90 only). `--env-out` writes those
choices as the engine reads them from LOOPSTACK_RING_CONFIGS (null where the library wins), so the same
device call can run the step with them: `LOOPSTACK_RING_CONFIGS="$(cat ring.json)" python -m runtime.bench ...`.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from pdl_bench import MODEL_SHAPES, graph_median_us  # noqa: E402

from hal.cuda import ring_gemv  # noqa: E402
from hal.cuda.blaslt import table_linear  # noqa: E402
from runtime.bench_rows import append_rows  # noqa: E402

L2_BYTES = 60 << 20


def _configs() -> list[ring_gemv.RingConfig]:
    grid = itertools.product((8, 16), (2, 4), (4, 6, 8), (4, 8))     # block_n, boxes, stages, warps
    configs = (ring_gemv.RingConfig(1, bn, 256, boxes, stages, warps) for bn, boxes, stages, warps in grid)
    return [c for c in configs if ring_gemv.ring_bytes(c) <= ring_gemv.MAX_RING_BYTES]


def sweep(name: str, n: int, k: int, library, configs) -> list[dict]:
    copies = max(2, -(-4 * L2_BYTES // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
    last = {}       # the library's last product (its memory belongs to the graph, which rewrites it)
    want = torch.nn.functional.linear(x.float(), weights[-1].float())
    mb = n * k * 2 / 1e6

    def row(variant: str, us: float, got: torch.Tensor) -> dict:
        rel = float((got.float() - want).norm() / want.norm())
        r = {"shape": name, "n": n, "k": k, "variant": variant, "us": round(us, 2),
             "tb_s": round(mb / us, 3), "rel": rel}
        print(f"{name:22s} {variant:34s} {us:8.2f} us  {r['tb_s']:.2f} TB/s  rel {rel:.2g}", flush=True)
        return r

    def run_library():
        for w in weights:
            last["y"] = library(x, w)

    rows = [row("library", graph_median_us(run_library) / copies, last["y"])]
    for config in configs:
        def run_ring(config=config):
            for w, o in zip(weights, outs):
                ring_gemv.ring_linear(x, w, config, out=o)
        try:
            rows.append({**row(f"ring {tuple(config)[1:]}", graph_median_us(run_ring) / copies, outs[-1]),
                         "config": list(config)})
        except Exception as e:  # noqa: BLE001 (reported, the sweep goes on)
            print(f"{name:22s} ring {tuple(config)[1:]} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    lib = rows[0]["us"]
    best = min(rows[1:], key=lambda r: r["us"], default=None)
    if best is not None:
        print(f"{name:22s} best {best['variant']}: {best['us']:.2f} us against the library's {lib:.2f} "
              f"({best['us'] / lib:.3f}x)", flush=True)
    return rows


def choices(rows: list[dict]) -> dict[str, list[int] | None]:
    """Per shape, the fastest ring config where it beats the library, else None (LOOPSTACK_RING_CONFIGS's
    JSON)."""
    by_shape: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        by_shape.setdefault((r["n"], r["k"]), []).append(r)
    out = {}
    for (n, k), shape_rows in by_shape.items():
        library = next(r["us"] for r in shape_rows if r["variant"] == "library")
        rings = [r for r in shape_rows if r.get("config")]
        best = min(rings, key=lambda r: r["us"], default=None)
        out[f"{n},{k}"] = best["config"] if best is not None and best["us"] < library else None
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="nanbeige4.2-3b,huginn-0125")
    p.add_argument("--out", default=None)
    p.add_argument("--env-out", default=None,
                   help="write the per-shape choices as LOOPSTACK_RING_CONFIGS's JSON")
    args = p.parse_args()
    torch.manual_seed(0)
    library = table_linear(torch.device("cuda")) or torch.nn.functional.linear
    configs = _configs()
    print(f"{torch.cuda.get_device_name()}: {len(configs)} ring configs; library "
          f"{'cuBLASLt table' if library is not torch.nn.functional.linear else 'F.linear'}", flush=True)
    rows = []
    for model in args.models.split(","):
        for name, n, k in MODEL_SHAPES[model]:
            shape_rows = sweep(f"{model}/{name}", n, k, library, configs)
            append_rows(args.out, shape_rows)        # each shape's as it finishes (a call's limit keeps them)
            rows += shape_rows
    if args.env_out:
        picked = choices(rows)
        ring_gemv.table_overrides(json.dumps(picked))     # the engine must accept what it is handed
        Path(args.env_out).write_text(json.dumps(picked))
        print(f"{ring_gemv.CONFIGS_ENV}={json.dumps(picked)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
