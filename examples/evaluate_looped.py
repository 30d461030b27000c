"""Held-out evaluation of a looped model: loss after 1..S loops, mean exit depth, loss-curve plot.

    PYTHONPATH=. python examples/evaluate_looped.py --checkpoint .out/ouro-tiny --corpus .out/corpus

prints (and with `--out` writes) JSON: `heldout_loss_by_loops` (mean next-token cross entropy, nats,
of the logits after 1, 2, ..., S loops), `mean_exit_loops` (per exit threshold q, the mean number
of loops a token runs when it exits at the first loop whose cumulative exit probability reaches q)
and `mean_exit_pdf` (the exit distribution averaged over tokens).
"""
from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import torch

from zoo.ouro import first_exit_step
from zoo.training import step_cross_entropy

EXIT_THRESHOLDS = (0.5, 0.9)


class HeldoutResult(NamedTuple):
    loss_by_loops: list[float]           # [S] cross entropy after 1..S loops
    mean_exit_loops: dict[str, float]    # threshold -> mean loops run (1..S); empty without a gate
    mean_exit_pdf: list[float]           # [S]; empty without a gate
    num_tokens: int                      # predicted tokens scored

    def as_json(self) -> dict[str, Any]:
        return {"heldout_loss_by_loops": {str(s + 1): round(v, 4) for s, v in enumerate(self.loss_by_loops)},
                "mean_exit_loops": {q: round(v, 3) for q, v in self.mean_exit_loops.items()},
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
    loss_sum = exit_sum = pdf_sum = None
    num_tokens = 0
    for batch in windows.split(batch_size):
        with autocast_for(batch.device):
            out = model(batch, return_step_logits=True)
        ce = step_cross_entropy(out.step_logits, batch)                   # [S, b, T-1]
        loss_sum = ce.sum((1, 2)) + (0 if loss_sum is None else loss_sum)
        num_tokens += ce[0].numel()
        if out.exit_pdf is not None:
            pdf = out.exit_pdf[:, :-1].float()                            # [b, T-1, S]
            loops = torch.stack([(first_exit_step(pdf, q) + 1).sum() for q in thresholds]).float()
            exit_sum = loops + (0 if exit_sum is None else exit_sum)
            pdf_sum = pdf.sum((0, 1)) + (0 if pdf_sum is None else pdf_sum)
    model.train(was_training)
    exits = {} if exit_sum is None else {str(q): v / num_tokens for q, v in zip(thresholds, exit_sum.tolist())}
    pdf_mean = [] if pdf_sum is None else (pdf_sum / num_tokens).tolist()
    return HeldoutResult((loss_sum / num_tokens).tolist(), exits, pdf_mean, num_tokens)


def plot_loss_curve(history: dict[str, list[dict[str, Any]]], path: str | Path) -> bool:
    """Train objective and held-out loss per loop count against tokens seen, as a PNG (matplotlib).
    Returns False, and draws nothing, where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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


def main() -> None:
    import zoo
    from looped_data import encode_documents, heldout_windows, read_corpus
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint folder (config.json, model.safetensors, "
                                                            "tokenizer.json)")
    parser.add_argument("--corpus", default=".out/corpus", help="folder with valid.txt")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", type=int, default=None, help="window length (default: the tokenizer's "
                                                                  "model_max_length)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=None, help="score at most this many held-out tokens")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args()

    folder, device = Path(args.checkpoint), torch.device(args.device)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    seq_len = args.seq_len or json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"]
    model = zoo.from_pretrained(folder, dtype="float32", device=device)
    tokens = encode_documents(tokenizer, read_corpus(args.corpus).valid).to(device)
    result = evaluate(model, heldout_windows(tokens, seq_len, args.max_tokens), args.batch_size).as_json()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
