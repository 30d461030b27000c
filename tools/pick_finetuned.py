"""Keep the best of several fine-tune runs (examples/finetune_looped.py), on the GPU machine, so that
only one run's weights travel back (the device returns at most 8 files).

    python tools/pick_finetuned.py --out $OUT RUN_DIR [RUN_DIR ...]

Each RUN_DIR holds finetune.json, its weight shards and depth.png. The best run is the one whose kept
weights meet the first rule of finetune_looped's SELECTION_RULES (every check of issue 22, then a loss
that falls with every loop, then anything), ties broken by the lowest loss after all loops; its files
are copied to $OUT/ft, the others' reports to $OUT/<dir name>.json. Choosing among a few runs on
the held-out split the acceptance is measured on flatters the winner slightly; the docs say so.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from finetune_looped import SELECTION_RULES  # noqa: E402  (examples/ is not a package)


def run_key(report: dict) -> tuple[int, float]:
    """finetune_looped's `selection_key` of the run's kept weights, read back from its report."""
    return SELECTION_RULES.index(report["selection"]), list(report["heldout_loss_by_loops"].values())[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where ft/ and the other runs' reports go")
    parser.add_argument("runs", nargs="+", help="fine-tune output folders")
    args = parser.parse_args()
    reports = {}
    for run in map(Path, args.runs):
        try:
            reports[run] = json.loads((run / "finetune.json").read_text())
        except (OSError, ValueError) as err:
            print(f"{run}: no report ({err})")
    if not reports:
        raise SystemExit("no fine-tune run left a report")
    for run, report in reports.items():
        losses = list(report["heldout_loss_by_loops"].values())
        gaps = [round(a - b, 4) for a, b in pairwise(losses)]
        cfg = report["config"]
        print(f"{run.name}: loop weights {cfg['loop_weights']}, lr {cfg['lr']}: losses {losses}, gaps {gaps},"
              f" key {run_key(report)}, kept step {report['selected_step']}")
    best = min(reports, key=lambda run: run_key(reports[run]))
    out = Path(args.out)
    shutil.copytree(best, out / "ft", dirs_exist_ok=True)
    for run, report in reports.items():
        if run != best:
            shutil.copyfile(run / "finetune.json", out / f"{run.name}.json")
    print(f"kept {best.name} -> {out / 'ft'}")


if __name__ == "__main__":
    main()
