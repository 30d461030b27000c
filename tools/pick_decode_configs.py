"""Pick the decode attention tile configs from a `tools/fp8_kernels_bench.py --only attn` run: for each
cache dtype, the swept config (table config included) with the least time summed over the batch-64 and
batch-128 cells, printed as `LOOPSTACK_KERNEL_CONFIGS` JSON (hal/kernels/configs.py) with the table
config's time beside it on stderr. The unified kernel's best config is always printed; where a
row-stream kernel config (hal/kernels/row_decode.py) beats it, that config is printed too, which
routes multi-head decode to that kernel.

    python tools/pick_decode_configs.py fp8_kernels.jsonl     # -> {"attention_decode": [16, 32, 4, 3, ...], ...}
"""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from dataclasses import astuple, replace

from hal.kernels.configs import configs_for

VARIANT = re.compile(r"^(bf16|fp8) (unified|rows) n(\d+) w(\d+) s(\d+) x(\d+)$")
KEYS = {"bf16": "attention_decode", "fp8": "attention_decode_fp8"}
ROW_KEYS = {"bf16": "attention_row_decode", "fp8": "attention_row_decode_fp8"}
CELLS = ("B64xK1024", "B128xK1024")


def pick(rows: list[dict], arch: str = "sm_90") -> tuple[dict[str, list[int]], list[str]]:
    """(`{config key: [block_m, block_n, num_warps, num_stages]}`, report lines)."""
    table = configs_for(arch)
    runs = []                                   # (dtype name, kernel, config, splits, shape, us)
    for row in rows:
        if row.get("group") != "attn" or row.get("shape") not in CELLS:
            continue
        name = row["variant"].split(" ", 1)[0]
        if row["variant"].endswith("(table config)"):
            c = table[KEYS[name]]
            runs.append((name, "unified", (c.block_m, c.block_n, c.num_warps, c.num_stages), 0, row["shape"],
                         row["us"]))
        elif m := VARIANT.match(row["variant"]):
            kind = m.group(2)
            n, w, s, x = map(int, m.groups()[2:])
            runs.append((name, kind, (16 if kind == "unified" else 1, n, w, s), x, row["shape"], row["us"]))
    # the table's split count is the sweep's smallest (the bench adds one run at twice it), and the
    # table-config row runs at it too (0 above); a config's time is its best run per cell
    table_splits = {(nm, shape): min((x for n2, _, _, x, s2, _ in runs if (n2, s2) == (nm, shape) and x),
                                     default=0)
                    for nm, _, _, _, shape, _ in runs}
    times: dict[tuple[str, str, tuple[int, ...]], dict[str, float]] = defaultdict(dict)
    for name, kind, config, x, shape, us in runs:
        if x in (0, table_splits[(name, shape)]):
            cell = times[(name, kind, config)]
            cell[shape] = min(us, cell.get(shape, float("inf")))
    chosen, report = {}, []
    for name, key in KEYS.items():
        c = table[key]
        current = (c.block_m, c.block_n, c.num_warps, c.num_stages)
        total = {(kind, cfg): sum(t.values()) for (nm, kind, cfg), t in times.items()
                 if nm == name and len(t) == len(CELLS)}
        unified = {cfg: t for (kind, cfg), t in total.items() if kind == "unified"}
        if not unified:
            continue
        best = min(unified, key=unified.get)
        # the table config's other fields (heads_first, ...) stay: the sweep varied only these four
        chosen[key] = list(astuple(replace(c, block_m=best[0], block_n=best[1], num_warps=best[2],
                                           num_stages=best[3])))
        report.append(f"{key}: table {list(current)} {unified.get(current, float('nan')):.1f} us, "
                      f"best {list(best)} {unified[best]:.1f} us (sum over {', '.join(CELLS)})")
        rows = {cfg: t for (kind, cfg), t in total.items() if kind == "rows"}
        if rows and min(rows.values()) < unified[best]:
            best_rows = min(rows, key=rows.get)
            chosen[ROW_KEYS[name]] = list(best_rows)
            report.append(f"{ROW_KEYS[name]}: best {list(best_rows)} {rows[best_rows]:.1f} us")
    return chosen, report


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    rows = [json.loads(line) for line in open(args[0]) if line.strip()]
    chosen, report = pick(rows)
    print("\n".join(report), file=sys.stderr)
    print(json.dumps(chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
