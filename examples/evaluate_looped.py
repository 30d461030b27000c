"""Held-out evaluation of a looped model: what each added loop buys, and what the exit gate spends.

    PYTHONPATH=. python examples/evaluate_looped.py --checkpoint .out/ouro-tiny --tokens .out/tokens

prints (and with `--out` writes) JSON:
- `heldout_loss_by_loops`: mean next-token cross entropy (nats) of the logits after 1, 2, ..., S loops;
- `exit_by_threshold`: per exit threshold q, where each token exits at the first loop whose
  cumulative exit probability reaches q (all S loops when none does): `mean_loops`, the `loss` of
  the logits at each token's exit loop, and `fraction_by_loops` (the exit-depth histogram);
  `mean_exit_loops` repeats the means, `mean_exit_pdf` is the exit distribution averaged over tokens;
- `tokens_per_s_by_loops` (with `--throughput-batches N > 0`): forward tokens per second at each
  fixed depth, batches of held-out windows on the evaluation device, after a warm-up.
With `--plot` it draws those three (loss by loops, exit histograms, throughput) into one PNG.
"""
from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import torch

from zoo.ouro import first_exit_step
from zoo.training import step_cross_entropy

EXIT_THRESHOLDS = (0.3, 0.5, 0.7, 0.9)


class HeldoutResult(NamedTuple):
    loss_by_loops: list[float]           # [S] cross entropy after 1..S loops
    exits: dict[str, dict[str, Any]]     # threshold -> mean_loops, loss, fraction_by_loops [S]; empty without a gate
    mean_exit_pdf: list[float]           # [S]; empty without a gate
    num_tokens: int                      # predicted tokens scored

    @property
    def mean_exit_loops(self) -> dict[str, float]:
        return {q: e["mean_loops"] for q, e in self.exits.items()}

    def as_json(self) -> dict[str, Any]:
        exits = {q: {"mean_loops": round(e["mean_loops"], 3), "loss": round(e["loss"], 4),
                     "fraction_by_loops": [round(f, 4) for f in e["fraction_by_loops"]]}
                 for q, e in self.exits.items()}
        return {"heldout_loss_by_loops": {str(s + 1): round(v, 4) for s, v in enumerate(self.loss_by_loops)},
                "mean_exit_loops": {q: e["mean_loops"] for q, e in exits.items()},
                "exit_by_threshold": exits,
                "mean_exit_pdf": [round(p, 4) for p in self.mean_exit_pdf],
                "heldout_tokens": self.num_tokens}


def autocast_for(device: torch.device):
    """bf16 autocast on accelerators; float32 on the CPU (bf16 matmuls there are slow and inexact)."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if device.type != "cpu" else nullcontext()


@torch.no_grad()
def evaluate(model: torch.nn.Module, windows: torch.Tensor, batch_size: int,
             thresholds: tuple[float, ...] = EXIT_THRESHOLDS) -> HeldoutResult:
    """Score `windows: [N, T]` (each row scored on its own; position t predicts t+1)."""
    was_training = model.training
    model.eval()
    loss_sum = pdf_sum = exit_loss = exit_counts = None
    num_tokens = 0
    for batch in windows.split(batch_size):
        with autocast_for(batch.device):
            out = model(batch, return_step_logits=True)
        ce = step_cross_entropy(out.step_logits, batch)                   # [S, b, T-1]
        loss_sum = ce.sum((1, 2)).double() + (0 if loss_sum is None else loss_sum)
        num_tokens += ce[0].numel()
        if out.exit_pdf is not None:
            pdf = out.exit_pdf[:, :-1].float()                            # [b, T-1, S]
            steps = torch.stack([first_exit_step(pdf, q) for q in thresholds])          # [Q, b, T-1]
            # the loss each token gets from the logits of the loop it exits at
            losses = ce.gather(0, steps)                                  # [Q, b, T-1]
            counts = torch.nn.functional.one_hot(steps.flatten(1), ce.shape[0]).sum(1)   # [Q, S]
            exit_loss = losses.sum((1, 2)).double() + (0 if exit_loss is None else exit_loss)
            exit_counts = counts + (0 if exit_counts is None else exit_counts)
            pdf_sum = pdf.sum((0, 1)) + (0 if pdf_sum is None else pdf_sum)
    model.train(was_training)
    exits: dict[str, dict[str, Any]] = {}
    if exit_counts is not None:
        loops = torch.arange(1, exit_counts.shape[1] + 1, device=exit_counts.device, dtype=torch.float64)
        for q, counts, loss in zip(thresholds, exit_counts.double(), exit_loss.tolist()):
            exits[str(q)] = {"mean_loops": float((counts * loops).sum() / num_tokens), "loss": loss / num_tokens,
                             "fraction_by_loops": (counts / num_tokens).tolist()}
    pdf_mean = [] if pdf_sum is None else (pdf_sum / num_tokens).tolist()
    return HeldoutResult((loss_sum / num_tokens).tolist(), exits, pdf_mean, num_tokens)


@torch.no_grad()
def throughput_by_loops(model: torch.nn.Module, windows: torch.Tensor, batch_size: int, num_batches: int = 4,
                        max_loops: int | None = None) -> dict[str, float]:
    """Forward tokens per second at each fixed depth 1..S (the last loop's logits only, as in a
    prefill), over `num_batches` batches of `windows` after one warm-up batch per depth."""
    was_training = model.training
    model.eval()
    device = windows.device
    max_loops = max_loops or model.default_num_loops
    batches = list(windows[: batch_size * num_batches].split(batch_size))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rates = {}
    for loops in range(1, max_loops + 1):
        with autocast_for(device):
            model(batches[0], num_loops=loops)                            # warm-up (kernels, caches)
            sync()
            start = time.perf_counter()
            for batch in batches:
                model(batch, num_loops=loops)
            sync()
        rates[str(loops)] = round(sum(b.numel() for b in batches) / (time.perf_counter() - start), 1)
    model.train(was_training)
    return rates


def plot_loss_curve(history: dict[str, list[dict[str, Any]]], path: str | Path) -> bool:
    """Train objective and held-out loss per loop count against tokens seen, as a PNG (matplotlib).
    Returns False, and draws nothing, where matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        print(f"matplotlib is not installed: no plot at {path} (the numbers are in the JSON)")
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    train = history.get("train", [])
    if train:
        ax.plot([r["tokens"] / 1e6 for r in train], [r["loss"] for r in train], color="0.7", lw=1,
                label="train objective")
    evals = history.get("eval", [])
    if evals:
        tokens = [r["tokens"] / 1e6 for r in evals]
        for s in range(len(evals[0]["loss_by_loops"])):
            ax.plot(tokens, [r["loss_by_loops"][s] for r in evals], marker="o", ms=3,
                    label=f"held-out, {s + 1} loop{'s' if s else ''}")
        ax.set_ylim(top=max(evals[0]["loss_by_loops"]) + 0.5)      # not the first steps' ln(vocab)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross entropy (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_depth(result: dict[str, Any], path: str | Path, title: str = "") -> bool:
    """One PNG of three panels from `as_json()` (plus `tokens_per_s_by_loops` if present): held-out
    loss after each loop count with the exit thresholds' losses as marks, the exit-depth histogram
    per threshold, and forward throughput per depth. False where matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        print(f"matplotlib is not installed: no plot at {path} (the numbers are in the JSON)")
        return False
    losses = result["heldout_loss_by_loops"]
    loops = [int(s) for s in losses]
    exits = result.get("exit_by_threshold", {})
    rates = result.get("tokens_per_s_by_loops", {})
    panels = 2 + bool(rates)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.8), dpi=120)
    ax = axes[0]
    ax.plot(loops, list(losses.values()), marker="o", color="C0", label="fixed depth")
    for i, (q, e) in enumerate(exits.items()):
        ax.scatter([e["mean_loops"]], [e["loss"]], marker="x", color=f"C{i + 1}", zorder=3,
                   label=f"exit at q={q}")
    ax.set_xticks(loops)
    ax.set_xlabel("loops run (mean, for the exits)")
    ax.set_ylabel("held-out cross entropy (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1]
    width = 0.8 / max(len(exits), 1)
    for i, (q, e) in enumerate(exits.items()):
        ax.bar([s + (i - (len(exits) - 1) / 2) * width for s in loops], e["fraction_by_loops"], width,
               color=f"C{i + 1}", label=f"q={q} (mean {e['mean_loops']:.2f})")
    ax.set_xticks(loops)
    ax.set_xlabel("exit loop")
    ax.set_ylabel("fraction of held-out tokens")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    if rates:
        ax = axes[2]
        ax.bar([int(s) for s in rates], [r / 1e3 for r in rates.values()], color="C0")
        ax.set_xticks(loops)
        ax.set_xlabel("loops (fixed depth)")
        ax.set_ylabel("forward tokens / s (thousands)")
        ax.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def main() -> None:
    import zoo
    from looped_data import encode_documents, heldout_windows, read_corpus, read_token_file, TOKEN_FILES
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint folder (config.json, model.safetensors, "
                                                            "tokenizer.json)")
    data = parser.add_mutually_exclusive_group()
    data.add_argument("--tokens", default=None, help="token folder (looped_data.py): its valid.u16.xz, the same "
                                                     "tokenizer as the checkpoint's")
    data.add_argument("--corpus", default=".out/corpus", help="folder with valid.txt, encoded with the "
                                                              "checkpoint's tokenizer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, default=None, help="window length (default: the tokenizer's "
                                                                  "model_max_length)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=None, help="score at most this many held-out tokens")
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(EXIT_THRESHOLDS))
    parser.add_argument("--throughput-batches", type=int, default=4, help="batches timed per depth; 0 = no timing")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    parser.add_argument("--plot", default=None, help="draw the depth plot (PNG) here")
    args = parser.parse_args()

    folder, device = Path(args.checkpoint), torch.device(args.device)
    seq_len = args.seq_len or json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"]
    model = zoo.from_pretrained(folder, dtype="float32", device=device)
    if args.tokens:
        tokens = read_token_file(Path(args.tokens) / TOKEN_FILES["valid"]).to(device)
    else:
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tokens = encode_documents(tokenizer, read_corpus(args.corpus).valid).to(device)
    windows = heldout_windows(tokens, seq_len, args.max_tokens)
    result = evaluate(model, windows, args.batch_size, tuple(args.thresholds)).as_json()
    if args.throughput_batches:
        result["tokens_per_s_by_loops"] = throughput_by_loops(model, windows, args.batch_size,
                                                              args.throughput_batches)
        result["throughput_device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot_depth(result, args.plot)


if __name__ == "__main__":
    main()
