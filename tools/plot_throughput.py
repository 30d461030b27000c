"""Plot decode throughput against batch size for kv_mode full and shared, with each cell's floor.

    python tools/plot_throughput.py BENCH.jsonl [...] --out docs/throughput.png

Reads the rows `runtime.bench` appends with `output=` (one JSON object per cell); keeps the
plain decode cells of one model (bf16, one GPU, no speculation, sync scheduling) and draws
measured tok/s (solid) beside the floor's
tok/s (dashed: batch / the cell's floor time, runtime/roofline.py). Needs matplotlib, which the
project itself does not depend on (`pip install matplotlib`).
"""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

PLAIN = ("off", "auto", "auto", False, 1)   # no speculation, bf16 KV and weights, sync scheduling, one GPU


def load_rows(paths: list[str], model: str) -> dict[str, dict[int, dict]]:
    """{kv_mode: {batch: row}}; a later file's row replaces an earlier one of the same cell."""
    cells: dict[str, dict[int, dict]] = defaultdict(dict)
    for path in paths:
        for line in open(path):
            row = json.loads(line)
            ms = row.get("decode_ms_step")
            variant = (row.get("spec", "off"), row.get("kv_dtype", "auto"), row.get("weights_dtype", "auto"),
                       bool(row.get("async_scheduling")), row.get("tp", 1))
            if row.get("model") != model or variant != PLAIN or ms is None or math.isnan(ms):
                continue
            cells[row.get("kv_mode", "full")][int(row["batch"])] = row
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", nargs="+", help="bench.jsonl files (runtime.bench output=)")
    parser.add_argument("--model", default="ouro-1.4b")
    parser.add_argument("--out", default="docs/throughput.png")
    args = parser.parse_args()

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = load_rows(args.bench, args.model)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for kv_mode, color, dy in (("full", "tab:blue", -12), ("shared", "tab:orange", 6)):
        rows = [cells[kv_mode][b] for b in sorted(cells.get(kv_mode, {}))]
        if not rows:
            continue
        batches = [r["batch"] for r in rows]
        ax.plot(batches, [r["decode_tok_s"] for r in rows], "o-", color=color, label=f"kv_mode={kv_mode}, measured")
        ax.plot(batches, [r["batch"] / r["decode_floor_ms"] * 1e3 for r in rows], "x--", color=color,
                label=f"kv_mode={kv_mode}, floor")
        for r in rows:
            ax.annotate(f"{r['decode_tok_s']:.0f}", (r["batch"], r["decode_tok_s"]), textcoords="offset points",
                        xytext=(4, dy), fontsize=7, color=color)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests (batch)")
    ax.set_ylabel("decode output tokens / s")
    ax.set_title(f"{args.model}, bf16, 4 loops, H200: decode throughput vs floor")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
