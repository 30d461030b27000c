"""Install a fine-tuned ouro-tiny (examples/finetune_looped.py) as the packaged checkpoint, and
rewrite the numbers the docs take from its report.

    python tools/install_finetuned.py RUN_DIR             # RUN_DIR: finetune.json, model-*.safetensors, depth.png
    python tools/install_finetuned.py RUN_DIR --dry-run   # check and show, write nothing

1. Checks the weight files against the report's SHA-256s and the packaged model's tensor names,
   shapes and dtypes, and that the fine-tune started from the packaged weights (a warning if not).
   Refuses weights that miss issue 22's acceptance unless `--force`.
2. Joins the shards into the one `model.safetensors` of `zoo/checkpoints/ouro-tiny/` (through
   `zoo.save_pretrained`, the layout the package ships); `config.json` and the tokenizer files are
   not touched. Reloads it and compares every tensor with the shards.
3. `docs/ouro-tiny-metrics.json`: the held-out keys become the report's, the former ones move to
   `before_finetune` (once: a second install keeps the first's), the rest of the report goes to
   `finetune`; the throughput per depth too where the report measured it.
4. `docs/ouro-tiny.md`: re-renders the blocks between `<!-- generated:NAME -->` and
   `<!-- /generated:NAME -->` from the metrics file (`render_blocks`); copies the run's `depth.png`
   to `docs/ouro-tiny-depth.png`.
5. Prints what it cannot rewrite: numbers made on the CPU with the former weights (the CPU check,
   the samples, the CPU speculation table) and prose elsewhere that quotes the losses.

`python tools/install_finetuned.py --render` only re-renders the docs' blocks from the metrics file.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
import tempfile
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EVAL_KEYS = ("heldout_loss_by_loops", "mean_exit_loops", "exit_by_threshold", "mean_exit_pdf", "heldout_tokens")
ACCEPTANCE_RULE = "acceptance"          # finetune_looped.SELECTION_RULES[0] starts with this word
BLOCK = re.compile(r"(<!-- generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated:(?P=name) -->)", re.DOTALL)


# ----- rendering the docs' numbers ---------------------------------------------------------------
def losses_of(metrics: dict[str, Any]) -> list[float]:
    return [metrics["heldout_loss_by_loops"][k] for k in sorted(metrics["heldout_loss_by_loops"], key=int)]


def fmt_int(value: float) -> str:
    return f"{round(value):,}"


def render_headline(m: dict[str, Any]) -> str:
    losses = losses_of(m)
    n = len(losses)
    parts = [f"{losses[0]:.3f} after 1 loop"] + [f"{v:.3f} after {i + 2}" for i, v in enumerate(losses[1:])]
    gains = [a - b for a, b in pairwise(losses)]
    if all(round(g, 4) > 0 for g in gains):
        pays = ("Every added loop pays: " + ", ".join(f"{g:.3f}" for g in gains)
                + f" nats for loops 2 to {n}.")
    else:
        paying = [i + 2 for i, g in enumerate(gains) if round(g, 4) > 0]
        failing = [i + 2 for i, g in enumerate(gains) if round(g, 4) <= 0]
        pays = (f"Loops {' and '.join(map(str, paying))} pay {sum(g for g in gains if g > 0):.2f} nats together; "
                + "; ".join(f"loop {s} does not pay ({-gains[s - 2]:.3f} worse than {s - 1}" for s in failing)
                + "; see Results).")
    gate = m["exit_by_threshold"]["0.5"]
    diff = gate["loss"] - losses[-1]
    than = (f"{-diff:.3f} better than" if diff < -0.0005 else f"{diff:.3f} worse than" if diff > 0.0005
            else "the same as")
    text = (f"What depth buys (held-out, nats/token): **{', '.join(parts[:-1])}, {parts[-1]}**. {pays} "
            f"The exit gate at threshold 0.5 runs {gate['mean_loops']:.2f} loops per token on average and scores "
            f"{gate['loss']:.3f}, {than} the fixed {n} loops.")
    if "finetune" in m:
        ft = m["finetune"]
        text += (f" (After a {ft['train_seconds']:.0f} s fine-tune that trains every loop's logits; see "
                 f"Training.)")
    return wrap(text)


def render_results(m: dict[str, Any]) -> str:
    losses = losses_of(m)
    loops = list(range(1, len(losses) + 1))
    head = "| loops | " + " | ".join(map(str, loops)) + " |\n|---" + "|---" * len(loops) + "|\n"
    rows = "| cross entropy (nats/token) | " + " | ".join(f"{v:.4f}" for v in losses) + " |\n"
    rates = m.get("tokens_per_s_by_loops")
    if rates:
        device = m.get("tokens_per_s_device", m.get("device", "")).replace("NVIDIA ", "")
        batch = m.get("finetune", {}).get("config", {}).get("eval_batch_size", 64) if "finetune" in m else 64
        rows += (f"| forward tokens/s, {device} (batch {batch} x 512) | "
                 + " | ".join(fmt_int(rates[str(s)]) for s in loops) + " |\n")
    exits = m["exit_by_threshold"]
    qs = list(exits)
    gate = ("| exit threshold q | " + " | ".join(qs) + " |\n|---" + "|---" * len(qs) + "|\n"
            + "| mean loops run per token | " + " | ".join(f"{exits[q]['mean_loops']:.3f}" for q in qs) + " |\n"
            + "| loss (nats/token) | " + " | ".join(f"{exits[q]['loss']:.4f}" for q in qs) + " |\n"
            + f"| tokens exiting at loop {' / '.join(map(str, loops))} | "
            + " | ".join(" / ".join(f"{100 * f + 1e-9:.1f}%" for f in exits[q]["fraction_by_loops"]) for q in qs) + " |\n")
    pdf = ", ".join(f"{p:.4f}" for p in m["mean_exit_pdf"])
    return (head + rows + "\n"
            + "Exit gate: each token exits at the first loop whose cumulative exit probability reaches q (all\n"
            + "four loops when none does); \"loss\" is the cross entropy of the logits at each token's exit loop.\n\n"
            + gate + "\n" + f"Mean exit distribution over loops 1..{len(loops)}: [{pdf}] (`mean_exit_pdf`).\n")


def acceptance_checks(m: dict[str, Any]) -> dict[str, bool]:
    losses = [round(v, 4) for v in losses_of(m)]
    gate = m["exit_by_threshold"]["0.5"]
    return {"ordered": all(a > b for a, b in pairwise(losses)),
            "gain": losses[0] - losses[-1] >= 0.15,
            "exit_depth": gate["mean_loops"] < len(losses),
            "exit_loss": abs(gate["loss"] - losses_of(m)[-1]) <= 0.03}


def render_acceptance(m: dict[str, Any]) -> str:
    losses = losses_of(m)
    n = len(losses)
    checks = acceptance_checks(m)
    chain = " > ".join(f"loss({s})" for s in range(1, n + 1))
    gate = m["exit_by_threshold"]["0.5"]
    diff = gate["loss"] - losses[-1]
    where = f"{abs(diff):.3f} *{'below' if diff < 0 else 'above'}* full depth"
    if checks["ordered"]:
        order = f"{chain} holds ({' / '.join(f'{v:.4f}' for v in losses)})"
    else:
        broken = [s + 1 for s in range(1, n) if not round(losses[s - 1], 4) > round(losses[s], 4)]
        order = (f"{' > '.join(f'loss({s})' for s in range(1, broken[0]))} holds but "
                 + ", ".join(f"**loss({s - 1}) > loss({s}) does not**: loop {s} is {losses[s - 1] - losses[s - 2]:.4f} "
                             f"nats worse than loop {s - 1}" for s in broken))
    text = (f"**Against issue 22's acceptance:** {order}; loss(1) - loss({n}) = {losses[0] - losses[-1]:.3f} "
            f"{'>=' if checks['gain'] else '<'} 0.15; at q = 0.5 the mean exit depth is {gate['mean_loops']:.2f} "
            f"({'<' if checks['exit_depth'] else 'not below'} {n}) and the loss is {where} "
            f"({'within' if checks['exit_loss'] else 'not within'} 0.03). "
            + ("**Every check holds.**" if all(checks.values()) else "**Not every check holds.**"))
    if "finetune" in m and "before_finetune" in m:
        before = m["before_finetune"]["heldout_loss_by_loops"]
        text += (" Before the fine-tune (Training) the losses were "
                 + " / ".join(f"{before[k]:.4f}" for k in sorted(before, key=int)) + ".")
    return wrap(text)


def render_finetune(m: dict[str, Any]) -> str:
    ft = m.get("finetune")
    if not ft:
        return "Not run yet: the packaged weights are those of the run above.\n"
    cfg = ft["config"]
    rows = [("hardware", f"{ft['device']}, torch {ft['torch']}"),
            ("steps, tokens, epochs", (f"{ft['steps']:,} steps, {ft['tokens']:,} tokens, {ft['epochs']} epochs of "
                                       f"the {ft['train_tokens']:,}-token subset")),
            ("training time, throughput", (f"{ft['train_seconds']} s, {ft['tokens_per_s']:,} tokens/s; held-out "
                                           f"evaluations {ft['eval_seconds']} s")),
            ("script wall time", f"{ft['wall_seconds']} s" if "wall_seconds" in ft else "-"),
            ("recipe", (f"lr {cfg['lr']:g} (warm-up {cfg['warmup_steps']}, cosine to {cfg['min_lr_ratio']:g}x), "
                        f"loop weights {cfg['loop_weights']}, gate beta {cfg['gate_entropy_weight']:g}, "
                        f"batches of {cfg['batch_size']} x 512")),
            ("kept", f"step {ft['selected_step']} ({ft['selection']})")]
    table = "| | |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)
    evals = ft["history"]["eval"]
    n = len(evals[0]["loss_by_loops"])
    hist = ("\n| step | tokens | " + " | ".join(f"loss({s})" for s in range(1, n + 1))
            + " | q=0.5: loops, loss | rule |\n|---|---|" + "---|" * n + "---|---|\n")
    for e in evals:
        hist += (f"| {e['step']} | {e['tokens']:,} | " + " | ".join(f"{v:.4f}" for v in e["loss_by_loops"])
                 + f" | {e['exit_0.5']['mean_loops']:.2f}, {e['exit_0.5']['loss']:.4f} | {e['rule']} |\n")
    return table + hist


RENDERERS = {"headline": render_headline, "results": render_results, "acceptance": render_acceptance,
             "finetune": render_finetune}


def render_blocks(text: str, metrics: dict[str, Any]) -> str:
    """`text` with every generated block's body replaced by its renderer's output."""
    def replace(match: re.Match) -> str:
        body = RENDERERS[match["name"]](metrics)
        return match[1] + body + ("" if body.endswith("\n") else "\n") + match[4]
    return BLOCK.sub(replace, text)


def wrap(text: str, width: int = 100) -> str:
    lines, line = [], ""
    for word in text.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join(lines + [line]) + "\n"


# ----- installing the weights --------------------------------------------------------------------
def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_shards(run: Path, report: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file

    files = sorted(run.glob("*.safetensors"))
    expected = report["weight_files"]
    if sorted(p.name for p in files) != sorted(expected):
        raise SystemExit(f"{run} holds {[p.name for p in files]}, the report names {sorted(expected)}")
    for path in files:
        if sha256(path) != expected[path.name]["sha256"]:
            raise SystemExit(f"{path} does not match the report's SHA-256 (a damaged transfer?)")
    tensors: dict[str, Any] = {}
    for path in files:
        tensors.update(load_file(str(path)))
    return tensors


def install_weights(tensors: dict[str, Any], checkpoint: Path, dry_run: bool) -> None:
    import torch

    import zoo

    model = zoo.from_pretrained(checkpoint, dtype=torch.bfloat16)
    state = model.state_dict()
    for name, tensor in tensors.items():
        if name not in state:
            raise SystemExit(f"{name} is not a weight of {checkpoint}")
        if tensor.shape != state[name].shape or tensor.dtype != state[name].dtype:
            raise SystemExit(f"{name}: {tuple(tensor.shape)} {tensor.dtype} against the packaged "
                             f"{tuple(state[name].shape)} {state[name].dtype}")
    missing = model.load_state_dict(tensors, strict=False).missing_keys
    tied = set(getattr(model, "tied_weights", {}))
    if set(missing) - tied:
        raise SystemExit(f"the shards lack {sorted(set(missing) - tied)}")
    if dry_run:
        return
    with tempfile.TemporaryDirectory() as tmp:
        zoo.save_pretrained(model, tmp, dtype=torch.bfloat16)
        shutil.copyfile(Path(tmp) / "model.safetensors", checkpoint / "model.safetensors")
    again = zoo.from_pretrained(checkpoint, dtype=torch.bfloat16).state_dict()
    for name, tensor in tensors.items():
        if not torch.equal(again[name], tensor):
            raise SystemExit(f"{name} differs after installing (this should not happen)")


def update_metrics(metrics: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    metrics = dict(metrics)
    if "before_finetune" not in metrics:
        metrics["before_finetune"] = {k: metrics[k] for k in EVAL_KEYS if k in metrics}
    for key in EVAL_KEYS:
        metrics[key] = report[key]
    if "tokens_per_s_by_loops" in report:
        metrics["before_finetune"].setdefault("tokens_per_s_by_loops", metrics.get("tokens_per_s_by_loops"))
        metrics["tokens_per_s_by_loops"] = report["tokens_per_s_by_loops"]
        metrics["tokens_per_s_device"] = report["device"]
    metrics["finetune"] = {k: v for k, v in report.items() if k not in EVAL_KEYS + ("tokens_per_s_by_loops",)}
    for key in ("cpu_check", "samples"):
        if isinstance(metrics.get(key), dict):
            metrics[key] = {**metrics[key], "weights": "before the fine-tune (tools/install_finetuned.py): stale"}
    return metrics


STALE = """Not rewritten (made with the former weights or quoted in prose); refresh by hand:
- docs/ouro-tiny.md, "CPU check of the shipped files": rerun
    PYTHONPATH=. python examples/evaluate_looped.py --checkpoint zoo/checkpoints/ouro-tiny --tokens .out/tokens \\
        --device cpu --max-tokens 65536 --batch-size 8 --throughput-batches 2
  and put its losses and tokens/s into the paragraph and `cpu_check` of docs/ouro-tiny-metrics.json;
- docs/ouro-tiny.md "Samples" (and `samples` in the metrics; README's sample): greedy samples with
    PYTHONPATH=. python -c "import sys; sys.path.insert(0, 'examples'); import train_looped as t, json; \\
print(json.dumps(t.greedy_samples('zoo/checkpoints/ouro-tiny'), indent=1))"
- docs/ouro-tiny.md "Self-speculation (CPU)" table: python tools/spec_speedup.py --new 64;
- docs/ouro-tiny.md "Training": the first paragraph's "Trained on one H200 in 389 s" may add the fine-tune;
- lines elsewhere that quote the former losses:"""


def quoted_elsewhere(before: dict[str, Any]) -> list[str]:
    losses = [before["heldout_loss_by_loops"][k] for k in sorted(before["heldout_loss_by_loops"], key=int)]
    needles = [" / ".join(f"{v:.3f}" for v in losses), f"{losses[-1]:.3f}", f"{losses[-1]:.2f} after"]
    hits = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.name == "ouro-tiny.md":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(n in line for n in needles) or (path.name == "README.md" and "2.85 after three" in line):
                hits.append(f"    {path.relative_to(ROOT)}:{number}: {line.strip()}")
    return hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", nargs="?", help="folder with finetune.json and the weight shards")
    parser.add_argument("--checkpoint", default=str(ROOT / "zoo" / "checkpoints" / "ouro-tiny"))
    parser.add_argument("--docs", default=str(ROOT / "docs" / "ouro-tiny.md"))
    parser.add_argument("--metrics", default=str(ROOT / "docs" / "ouro-tiny-metrics.json"))
    parser.add_argument("--plot", default=str(ROOT / "docs" / "ouro-tiny-depth.png"))
    parser.add_argument("--dry-run", action="store_true", help="check and print; write nothing")
    parser.add_argument("--force", action="store_true", help="install weights that miss the acceptance too")
    parser.add_argument("--render", action="store_true", help="only re-render the docs' blocks from --metrics")
    args = parser.parse_args(argv)
    docs, metrics_path = Path(args.docs), Path(args.metrics)
    metrics = json.loads(metrics_path.read_text())
    if args.render:
        docs.write_text(render_blocks(docs.read_text(), metrics))
        return 0
    if not args.run:
        parser.error("give the run folder (or --render)")
    run, checkpoint = Path(args.run), Path(args.checkpoint)
    report = json.loads((run / "finetune.json").read_text())
    print(f"report: selected step {report['selected_step']} of {report['steps']}; {report['selection']}")
    print("held-out loss by loops:", report["heldout_loss_by_loops"], "acceptance:", report["acceptance"])
    if not report["selection"].startswith(ACCEPTANCE_RULE) and not args.force:
        print("these weights miss issue 22's acceptance: not installed (--force installs them anyway)")
        return 1
    packaged = {p.name: sha256(p) for p in sorted(checkpoint.glob("*.safetensors"))}
    if packaged != report.get("init_weights_sha256"):
        print(f"warning: the fine-tune started from other weights than {checkpoint}'s "
              f"({report.get('init_weights_sha256')} against {packaged})")
    tensors = read_shards(run, report)
    install_weights(tensors, checkpoint, args.dry_run)
    new_metrics = update_metrics(metrics, report)
    new_docs = render_blocks(docs.read_text(), new_metrics)
    if args.dry_run:
        print(f"--dry-run: {len(tensors)} tensors check out; {docs} would read:\n")
        for match in BLOCK.finditer(new_docs):
            print(f"[{match['name']}]\n{match['body']}")
    else:
        metrics_path.write_text(json.dumps(new_metrics, indent=2) + "\n")
        docs.write_text(new_docs)
        if (run / "depth.png").is_file():
            shutil.copyfile(run / "depth.png", args.plot)
        else:
            print(f"no depth.png in {run}: redraw {args.plot} with examples/evaluate_looped.py --plot")
        print(f"installed {checkpoint / 'model.safetensors'}; rewrote {metrics_path} and {docs}")
    print(STALE)
    print("\n".join(quoted_elsewhere(new_metrics["before_finetune"])) or "    (none found)")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
