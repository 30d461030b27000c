"""Train a small Ouro-architecture looped model from scratch: plain PyTorch, no Hydra.

    python examples/prepare_corpus.py --out .out/corpus                 # once, on a Debian machine
    PYTHONPATH=. python examples/looped_data.py --corpus .out/corpus --out .out/tokens   # once: tokenizer, ids
    PYTHONPATH=. python examples/train_looped.py --tokens .out/tokens --out .out/ouro-tiny --max-minutes 6

(`--corpus DIR` instead of `--tokens DIR` trains the tokenizer and encodes the text in the run.)
AdamW, linear warm-up then cosine decay, bf16 autocast on accelerators (float32 on the CPU), Ouro's
expected-loss objective with an entropy regulariser on the exit gate, periodic held-out evaluation
(the best full-depth held-out loss is kept), and a checkpoint in the layout `zoo.from_pretrained`
and `python -m runtime.generate model.path=...` read. Training stops at whichever of
`--max-minutes` (whole script, wall clock), `--max-steps` or `--max-epochs` comes first; the cosine
schedule follows the same budget, so it always ends decayed.

Depth schedule: with `--entropy-weight-start B0` the regulariser's weight starts at B0 and falls
geometrically to `--entropy-weight` over the first `--entropy-anneal` of the budget. A large weight
holds the exit distribution near uniform, so every loop's logits are trained alike while the loops
learn to refine each other; as it falls, the gate learns which depth each token needs and the
objective turns to the paper's `sum_s p_s * CE_s - beta * H(p)` (see `depth_entropy_weight`).

The report folder gets `metrics.json` (held-out loss at 1..S loops, exit depth per threshold,
forward tokens/s per depth, throughput, history), `loss_curve.png` and `depth.png`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

import zoo
from evaluate_looped import autocast_for, evaluate, plot_depth, plot_loss_curve, throughput_by_loops
from looped_data import (encode_corpus, heldout_windows, random_windows, read_corpus, read_tokens, save_tokenizer,
                         train_tokenizer)
from looped_optim import Budget, learning_rate, make_optimizer
from zoo.training import sample_num_loops

SAMPLE_PROMPTS = ("The meaning of life is", "And the LORD said unto Moses,", "To create a new branch in Git,",
                  "The kernel uses")


@dataclass(frozen=True)
class TrainConfig:
    corpus: str = ".out/corpus"        # folder with train.txt, valid.txt (prepare_corpus.py)
    tokens: str = ""                   # or a token folder (looped_data.py): tokenizer and ids made once
    out: str = ".out/ouro-tiny"        # checkpoint folder
    report: str = ""                   # metrics.json + loss_curve.png; "" means <out>-report
    device: str = "auto"               # auto: cuda if available, else cpu
    max_minutes: float = 6.0           # wall-clock budget of the whole script; 0 = none
    max_steps: int = 0                 # 0 = none
    max_epochs: float = 20.0           # passes over the train tokens; 0 = none (the data is small)
    reserve_seconds: float = 30.0      # kept from max_minutes for the final evaluation and save
    batch_size: int = 128              # sequences per step (eager GPU steps are host-bound: go wide)
    seq_len: int = 256
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1          # the cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    vocab_size: int = 8192             # BPE vocabulary, special tokens included
    hidden_size: int = 256
    intermediate_size: int = 704
    num_layers: int = 8
    num_heads: int = 4
    num_loops: int = 4
    tie_embeddings: bool = False       # the output head reuses the input embedding (half the vocab weights)
    rope_theta: float = 10000.0
    loss_type: str = "expected_loss"   # or expected_logits (the released reference code's loss)
    entropy_weight: float = 0.05       # beta of the exit-distribution entropy (expected_loss only)
    entropy_weight_start: float = 0.0  # > entropy_weight: beta starts here and decays to entropy_weight
    entropy_anneal: float = 0.5        # ... over this fraction of the budget (geometric), then stays
    mean_loops: float = 0.0            # > 1: sample the loop count per batch around this mean (Huginn style)
    compile: bool = False              # torch.compile the training forward (eager if compiling fails)
    grad_checkpointing: bool = False   # recompute each loop in backward
    eval_every: int = 50               # steps between held-out evaluations (about one epoch)
    eval_tokens: int = 1 << 20         # held-out tokens scored by each periodic evaluation
    eval_batch_size: int = 64
    final_eval_tokens: int = 0         # held-out tokens scored for the report; 0 = all (slow on a CPU)
    throughput_batches: int = 4        # batches timed per depth for tokens_per_s_by_loops; 0 = none
    log_every: int = 20                # steps between loss readbacks (the only host syncs)
    seed: int = 0
    progress: bool = True              # tqdm bar
    samples: bool = True               # greedy completions of SAMPLE_PROMPTS into the report
    shard_mb: float = 0.0              # > 0: weight files of at most this many MB (a transfer limit)


def config_parser(config_class: type, description: str) -> argparse.ArgumentParser:
    """One flag per field of the dataclass `config_class`: `--max-steps` for `max_steps`, typed by
    the default, `--x/--no-x` for booleans (finetune_looped.py's config is parsed the same way)."""
    parser = argparse.ArgumentParser(description=description)
    for field in dataclasses.fields(config_class):
        flag = "--" + field.name.replace("_", "-")
        if isinstance(field.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(flag, type=type(field.default), default=field.default)
    return parser


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    parser = config_parser(TrainConfig, __doc__.split("\n\n")[0])
    cfg = TrainConfig(**vars(parser.parse_args(argv)))
    if not (cfg.max_minutes or cfg.max_steps or cfg.max_epochs):
        parser.error("give a budget: --max-minutes, --max-steps or --max-epochs")
    return cfg


def model_config(cfg: TrainConfig, vocab_size: int) -> dict[str, Any]:
    return {"model_type": "ouro", "vocab_size": vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
            "max_position_embeddings": cfg.seq_len, "rope_theta": cfg.rope_theta, "rms_norm_eps": 1e-6,
            "total_ut_steps": cfg.num_loops, "early_exit_threshold": 1.0, "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "float32"}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def save_checkpoint(model: torch.nn.Module, tokenizer: Any, folder: str | Path, seq_len: int,
                    shard_mb: float = 0.0) -> Path:
    """The shipped layout: config.json + model.safetensors (bf16) + tokenizer.json + tokenizer_config.json."""
    folder = zoo.save_pretrained(model, folder, dtype=torch.bfloat16, max_shard_bytes=int(shard_mb * 1e6) or None)
    save_tokenizer(tokenizer, folder, model_max_length=seq_len)
    return folder


def greedy_samples(folder: Path, max_tokens: int = 48) -> dict[str, str]:
    """What `python -m runtime.generate model.path=<folder> prompt=...` prints (CPU, greedy); the
    runtime's error instead of text where it cannot run here (training has succeeded regardless)."""
    try:
        from runtime import LLM, SamplingParams

        llm = LLM(str(folder), hal="cpu")
        outputs = llm.generate(list(SAMPLE_PROMPTS), SamplingParams(max_tokens=max_tokens, temperature=0))
    except Exception as exc:  # e.g. a runtime dependency missing on the training machine
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {prompt: out.text for prompt, out in zip(SAMPLE_PROMPTS, outputs)}


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Runs the whole job; returns the metrics it also writes to `<report>/metrics.json`."""
    t_start = time.time()
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    if cfg.tokens:
        tokenizer, data, token_manifest = read_tokens(cfg.tokens, device)
        manifest = token_manifest.get("corpus_manifest")
    else:
        corpus = read_corpus(cfg.corpus)
        tokenizer = train_tokenizer(corpus.train, cfg.vocab_size)
        data = encode_corpus(tokenizer, corpus, device)
        manifest = corpus_manifest(cfg.corpus)
    vocab_size = -(-tokenizer.get_vocab_size() // 64) * 64            # padded for tensor-core shapes
    periodic_windows = heldout_windows(data.valid, cfg.seq_len, cfg.eval_tokens)
    model = zoo.from_config(model_config(cfg, vocab_size), dtype=torch.float32, device=device, seed=cfg.seed).train()
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable()
    forward = torch.compile(model) if cfg.compile else model
    compiled = cfg.compile
    optimizer = make_optimizer(model, cfg, device)
    print(f"ouro: {model.num_parameters():,} parameters, {cfg.num_loops} loops; train {data.train.numel():,} "
          f"tokens, held-out {data.valid.numel():,}; vocab {tokenizer.get_vocab_size()}; device {device}; "
          f"setup {time.time() - t_start:.1f}s", flush=True)

    batch_gen = torch.Generator(device=device).manual_seed(cfg.seed)
    loops_gen = torch.Generator().manual_seed(cfg.seed)
    loss_kwargs = {"loss_type": cfg.loss_type}
    if cfg.loss_type == "expected_loss":
        loss_kwargs["entropy_weight"] = cfg.entropy_weight
    budget = Budget(cfg, t_start, data.train.numel())
    history: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    best: dict[str, Any] | None = None
    step = tokens = window_steps = 0
    eval_seconds = 0.0
    loss_sum = torch.zeros((), device=device)
    window_start = train_start = time.time()
    bar = tqdm(total=cfg.max_steps or None, unit="step", dynamic_ncols=True, disable=not cfg.progress,
               mininterval=0.5 if sys.stderr.isatty() else 15.0)         # a log file gets few redraws
    while (progress := budget.progress(step, tokens)) < 1.0:
        lr = learning_rate(cfg, step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = random_windows(data.train, cfg.batch_size, cfg.seq_len, batch_gen)     # [B, T]
        num_loops = (sample_num_loops(cfg.mean_loops, max_loops=2 * cfg.num_loops, generator=loops_gen)
                     if cfg.mean_loops > 1 else cfg.num_loops)
        if cfg.loss_type == "expected_loss":
            beta = depth_entropy_weight(cfg, progress)
            # a compiled graph would specialise on a Python float (a recompile per value): a tensor
            loss_kwargs["entropy_weight"] = torch.tensor(beta, device=device) if compiled else beta
        try:
            with autocast_for(device):
                out = forward(ids, labels=ids, num_loops=num_loops, **loss_kwargs)
            out.loss.backward()
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not cost the run: go eager
            if not compiled or step > 0:
                raise
            print(f"torch.compile failed ({type(exc).__name__}: {str(exc)[:300]}); training eagerly", flush=True)
            optimizer.zero_grad(set_to_none=True)
            forward, compiled = model, False
            with autocast_for(device):
                out = forward(ids, labels=ids, num_loops=num_loops, **loss_kwargs)
            out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, tokens, window_steps = step + 1, tokens + ids.numel(), window_steps + 1
        loss_sum += out.loss.detach()
        bar.update(1)
        if step == 1 or step % cfg.log_every == 0:
            loss = (loss_sum / window_steps).item()                            # host sync
            now = time.time()
            rate = window_steps * ids.numel() / (now - window_start)
            if step == 1:
                budget.clock_start, train_start, rate = now, now, 0.0         # compile / warm-up excluded
            history["train"].append({"step": step, "tokens": tokens, "loss": loss, "lr": lr, "tokens_per_s": rate,
                                     **({"entropy_weight": round(beta, 5)} if cfg.loss_type == "expected_loss" else {})})
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{rate:,.0f}",
                            epoch=f"{tokens / data.train.numel():.1f}")
            if not math.isfinite(loss):
                print(f"loss is {loss} at step {step}: stopping; the best evaluated weights are kept")
                break
            loss_sum.zero_()
            window_steps, window_start = 0, now
        if step % cfg.eval_every == 0:
            eval_start = time.time()
            best = evaluate_and_keep(model, periodic_windows, cfg, step, tokens, history, best)
            eval_seconds += time.time() - eval_start
            window_start += time.time() - eval_start                             # throughput of training only
    bar.close()
    train_seconds = time.time() - train_start - eval_seconds

    if not history["eval"] or history["eval"][-1]["step"] != step:
        best = evaluate_and_keep(model, periodic_windows, cfg, step, tokens, history, best)
    model.load_state_dict(best["state"])
    folder = save_checkpoint(model, tokenizer, cfg.out, cfg.seq_len, cfg.shard_mb)
    shipped = zoo.from_pretrained(folder, dtype=torch.float32, device=device)  # score what ships (bf16 weights)
    final_windows = heldout_windows(data.valid, cfg.seq_len, cfg.final_eval_tokens or None)
    final = evaluate(shipped, final_windows, cfg.eval_batch_size).as_json()
    if cfg.throughput_batches:
        final["tokens_per_s_by_loops"] = throughput_by_loops(shipped, final_windows, cfg.eval_batch_size,
                                                             cfg.throughput_batches)
    metrics = {**final, "selected_step": best["step"], "steps": step, "tokens": tokens,
               "epochs": round(tokens / data.train.numel(), 2), "train_seconds": round(train_seconds, 1),
               "tokens_per_s": round((tokens - cfg.batch_size * cfg.seq_len) / max(train_seconds, 1e-9)),
               "num_parameters": model.num_parameters(), "train_tokens": data.train.numel(),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
               "compiled": compiled, "torch": torch.__version__, "config": dataclasses.asdict(cfg), "corpus": manifest,
               "history": history}
    report = Path(cfg.report or f"{cfg.out}-report")
    report.mkdir(parents=True, exist_ok=True)
    write_json(report / "metrics.json", metrics)                  # first, so a failure below loses nothing
    metrics["loss_curve"] = "loss_curve.png" if plot_loss_curve(history, report / "loss_curve.png") else None
    metrics["depth_plot"] = "depth.png" if plot_depth(final, report / "depth.png") else None
    if cfg.samples:
        metrics["samples"] = greedy_samples(folder)
    metrics["wall_seconds"] = round(time.time() - t_start, 1)
    write_json(report / "metrics.json", metrics)
    summary = ("heldout_loss_by_loops", "exit_by_threshold", "tokens_per_s_by_loops", "selected_step", "steps",
               "epochs", "tokens_per_s", "train_seconds", "compiled", "wall_seconds")
    print(json.dumps({k: metrics[k] for k in summary}, indent=2))
    print(f"checkpoint: {folder}  report: {report}")
    return metrics


def depth_entropy_weight(cfg: TrainConfig, progress: float) -> float:
    """The entropy regulariser's weight at `progress` in [0, 1]: `entropy_weight_start` decaying
    geometrically to `entropy_weight` over the first `entropy_anneal` of the budget, then constant
    (just `entropy_weight` when no start above it is given)."""
    start, end = cfg.entropy_weight_start, cfg.entropy_weight
    if start <= end or end <= 0:
        return end
    fraction = min(1.0, progress / cfg.entropy_anneal) if cfg.entropy_anneal > 0 else 1.0
    return start * (end / start) ** fraction


def evaluate_and_keep(model: torch.nn.Module, windows: torch.Tensor, cfg: TrainConfig, step: int, tokens: int,
                      history: dict[str, list[dict[str, Any]]], best: dict[str, Any] | None) -> dict[str, Any]:
    """Held-out loss at every depth; keeps a copy of the weights with the best full-depth loss."""
    result = evaluate(model, windows, cfg.eval_batch_size)
    history["eval"].append({"step": step, "tokens": tokens, "loss_by_loops": result.loss_by_loops,
                            "mean_exit_loops": result.mean_exit_loops})
    loss = result.loss_by_loops[-1]
    tqdm.write(f"step {step}: held-out loss by loops {[round(v, 3) for v in result.loss_by_loops]}, "
               f"mean exit loops {result.mean_exit_loops}")
    if best is None or (math.isfinite(loss) and loss < best["loss"]):
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        best = {"loss": loss, "step": step, "state": state}
    return best


def corpus_manifest(folder: str) -> dict[str, Any] | None:
    path = Path(folder) / "corpus.json"
    return json.loads(path.read_text()) if path.is_file() else None


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


if __name__ == "__main__":
    train(parse_args())
