"""Fine-tune a trained looped model for a short while so that every added loop pays: plain PyTorch.

    PYTHONPATH=. python examples/finetune_looped.py --init zoo/checkpoints/ouro-tiny --tokens .out/tokens \
        --out .out/ouro-tiny-ft --max-seconds 125

Starts from a checkpoint folder (its config and tokenizer are kept; the token folder must hold ids
of that tokenizer, which is checked) and trains it with `train_looped.py`'s optimiser, schedule and
budget: AdamW, a short warm-up, cosine decay to `min_lr_ratio`, bf16 autocast on accelerators.

Objective, per predicted token (`depth_objective`):

    sum_s w_s * CE_s  +  [ sum_s p_s * sg(CE_s) - beta * H(p) ]

The first term trains the logits after every loop with fixed weights (`--loop-weights`, normalised;
the default 1,2,3,4 gives the deepest loop the most), whatever the exit gate says; Ouro's expected
loss weights loop s by the gate's p_s, so a loop the gate neglects learns less. The bracket is the
expected loss with the cross entropies held constant (sg = stop-gradient): it trains only the exit
distribution p, as in pre-training (beta = `--gate-entropy-weight`), so the gate keeps learning which
depth each token needs while the loops improve.

Held-out evaluation at step 0, every `--eval-every` steps from `--eval-start` on, and at the end scores the weights rounded to bf16 (what
is saved) on the held-out split (`--eval-tokens`, 0 = all of it), and the weights kept are chosen by
`selection_key`: first those that meet issue 22's acceptance (loss falls strictly with every loop at
4 decimals, loss(1) - loss(S) >= 0.15, at exit threshold 0.5 a mean depth below S and a loss within
0.03 of full depth), then those whose loss merely falls with every loop, then any; among them the
lowest loss after all loops. The report says which rule picked them (`selection`).

Output: bf16 safetensors in `--out` (shards of at most `--shard-mb` MB), with the checkpoint's
config.json, tokenizer.json and tokenizer_config.json unless `--weights-only`; the report JSON
(`finetune.json`: loss per loop count, exit-depth histogram and loss at the exit thresholds, the
evaluation history, the weight files' SHA-256) and `depth.png` where matplotlib is installed, in
`--report` (default: `--out`).
"""
from __future__ import annotations

import time

T0 = time.time()                         # the budget counts from here: imports and data loading included

import dataclasses
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from evaluate_looped import HeldoutResult, autocast_for, evaluate, plot_depth, throughput_by_loops
from looped_data import TOKEN_FILES, epoch_windows, heldout_windows, read_token_file, sha256_file
from looped_optim import Budget, learning_rate, make_optimizer
from train_looped import config_parser, resolve_device, write_json

import zoo
from zoo.training import exit_entropy, step_cross_entropy

CHECKPOINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class FinetuneConfig:
    init: str = "zoo/checkpoints/ouro-tiny"   # checkpoint folder to start from (config, weights, tokenizer)
    tokens: str = ".out/tokens"        # token folder (looped_data.py) with ids of the checkpoint's tokenizer
    out: str = ".out/ouro-tiny-ft"     # output folder
    report: str = ""                   # finetune.json + depth.png; "" means --out
    weights_only: bool = False         # --out gets the weight files only (config and tokenizer are --init's)
    device: str = "auto"               # auto: cuda if available, else cpu
    max_seconds: float = 125.0         # wall clock of the whole script (imports included); 0 = none
    reserve_seconds: float = 10.0      # kept from max_seconds for the last evaluation and the save
    max_steps: int = 0                 # 0 = none
    max_epochs: float = 0.0            # passes over the train tokens; 0 = none
    batch_size: int = 128              # sequences per step
    seq_len: int = 0                   # 0: the checkpoint's max_position_embeddings
    lr: float = 3e-4                   # peak; pre-training ended at 1.5e-4 after a cosine from 1.5e-3
    min_lr_ratio: float = 0.1          # the cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20             # fresh AdamW moments: a few steps before the peak
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    loop_weights: str = "1,2,3,4"      # weight of each loop's cross entropy (normalised to sum 1)
    gate_entropy_weight: float = 0.05  # beta of the gate's objective (pre-training ended at 0.05)
    eval_every: int = 60               # steps between held-out evaluations (and one at step 0 and at the end)
    eval_start: int = 0                # no periodic evaluation before this step (the early, high-lr weights are
                                       # rarely the ones kept: the evaluations' time goes to training instead)
    eval_tokens: int = 0               # held-out tokens per evaluation; 0 = the whole split
    eval_batch_size: int = 64
    throughput_batches: int = 0        # > 0: forward tokens/s per depth of the kept weights, into the report
    log_every: int = 20                # steps between loss readbacks
    seed: int = 22
    shard_mb: float = 15.0             # weight files of at most this many MB (a transfer limit); 0 = one file

    @property
    def max_minutes(self) -> float:    # the names Budget reads
        return self.max_seconds / 60


def parse_args(argv: list[str] | None = None) -> FinetuneConfig:
    parser = config_parser(FinetuneConfig, __doc__.split("\n\n")[0])
    cfg = FinetuneConfig(**vars(parser.parse_args(argv)))
    if not (cfg.max_seconds or cfg.max_steps or cfg.max_epochs):
        parser.error("give a budget: --max-seconds, --max-steps or --max-epochs")
    return cfg


def parse_loop_weights(text: str, num_loops: int) -> torch.Tensor:
    weights = torch.tensor([float(w) for w in text.split(",")], dtype=torch.float32)
    if weights.numel() != num_loops or (weights < 0).any() or weights.sum() <= 0:
        raise SystemExit(f"--loop-weights {text!r}: need {num_loops} non-negative weights, not all 0")
    return weights / weights.sum()


def check_tokens_match(init: Path, tokens: Path, vocab_size: int) -> dict[str, Any]:
    """The token folder's ids must come from the checkpoint's tokenizer: same tokenizer.json (by
    the SHA-256 that `tokens.json` records, or the folder's own tokenizer.json)."""
    manifest = json.loads((tokens / "tokens.json").read_text())
    have = sha256_file(init / "tokenizer.json")
    want = manifest.get("tokenizer_sha256")
    if want is None and (tokens / "tokenizer.json").is_file():
        want = sha256_file(tokens / "tokenizer.json")
    if want is None:
        print(f"warning: {tokens} does not say which tokenizer made its ids; assuming {init}'s")
    elif want != have:
        raise SystemExit(f"{tokens} holds ids of another tokenizer than {init}/tokenizer.json "
                         f"(SHA-256 {want[:12]} against {have[:12]}): fine-tune the checkpoint its ids were made for")
    if manifest.get("vocab_size", 0) > vocab_size:
        raise SystemExit(f"{tokens} has a vocabulary of {manifest['vocab_size']}, the model {vocab_size}")
    return manifest


@dataclass
class DepthObjective:
    loss: torch.Tensor                 # scalar to minimise
    step_losses: torch.Tensor          # [S] mean cross entropy after each loop (no gradient)


def depth_objective(step_logits: torch.Tensor, exit_pdf: torch.Tensor, ids: torch.Tensor, loop_weights: torch.Tensor,
                    gate_entropy_weight: float) -> DepthObjective:
    """`sum_s w_s * CE_s + sum_s p_s * sg(CE_s) - beta * H(p)`, the mean over predicted tokens
    (see the module doc). `step_logits: [S, B, T, V]`, `exit_pdf: [B, T, S]`, `ids: [B, T]`."""
    ce = step_cross_entropy(step_logits, ids)                                 # [S, B, T-1] float32
    step_losses = ce.mean((1, 2))                                             # [S]
    pdf = exit_pdf[:, :-1].float()                                            # [B, T-1, S]
    gate = (pdf.permute(2, 0, 1) * ce.detach()).sum(0).mean() - gate_entropy_weight * exit_entropy(pdf).mean()
    return DepthObjective((loop_weights.to(ce.device) * step_losses).sum() + gate, step_losses.detach())


# ----- choosing the weights to keep ---------------------------------------------------------------
def acceptance(result: HeldoutResult) -> dict[str, bool]:
    """Issue 22's acceptance on one evaluation (losses at the 4 decimals the docs print)."""
    losses = [round(v, 4) for v in result.loss_by_loops]
    full = len(losses)
    gate = result.exits.get("0.5")
    checks = {"loss_falls_with_every_loop": all(a > b for a, b in pairwise(losses)),
              "first_minus_last_at_least_0.15": losses[0] - losses[-1] >= 0.15}
    if gate is not None:
        checks["exit_0.5_mean_below_full"] = gate["mean_loops"] < full
        checks["exit_0.5_loss_within_0.03"] = abs(gate["loss"] - result.loss_by_loops[-1]) <= 0.03
    return checks


SELECTION_RULES = ("acceptance: every check of issue 22 holds, then the lowest loss(S)",
                   "ordered: loss falls with every loop (not every other check holds), then the lowest loss(S)",
                   "fallback: no evaluated weights have a loss that falls with every loop; the lowest loss(S)")


def selection_key(result: HeldoutResult) -> tuple[int, float]:
    """Smaller is better: (the first rule of SELECTION_RULES the result meets, loss after all loops)."""
    checks = acceptance(result)
    tier = 0 if all(checks.values()) else 1 if checks["loss_falls_with_every_loop"] else 2
    loss = result.loss_by_loops[-1]
    return tier, loss if math.isfinite(loss) else math.inf


# ----- the run ------------------------------------------------------------------------------------
def finetune(cfg: FinetuneConfig) -> dict[str, Any]:
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    init, tokens_dir = Path(cfg.init), Path(cfg.tokens)
    model = zoo.from_pretrained(init, dtype=torch.float32, device=device).train()
    scorer = zoo.from_pretrained(init, dtype=torch.float32, device=device).eval()   # holds the bf16-rounded copy
    manifest = check_tokens_match(init, tokens_dir, model.config.vocab_size)
    train_ids, valid_ids = (read_token_file(tokens_dir / TOKEN_FILES[s]).to(device) for s in ("train", "valid"))
    seq_len = cfg.seq_len or model.config.max_position_embeddings
    num_loops = model.default_num_loops
    loop_weights = parse_loop_weights(cfg.loop_weights, num_loops).to(device)
    windows = heldout_windows(valid_ids, seq_len, cfg.eval_tokens or None)
    optimizer = make_optimizer(model, cfg, device)
    budget = Budget(cfg, T0, train_ids.numel())
    batches = epoch_windows(train_ids, cfg.batch_size, seq_len, torch.Generator().manual_seed(cfg.seed))
    print(f"finetune {init}: {model.num_parameters():,} parameters, {num_loops} loops, loop weights "
          f"{[round(w, 3) for w in loop_weights.tolist()]}; train {train_ids.numel():,} tokens, held-out windows "
          f"{tuple(windows.shape)}; device {device}; setup {time.time() - T0:.1f}s", flush=True)

    history: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
    best: dict[str, Any] = {}
    eval_seconds = 0.0

    def evaluate_and_keep(step: int, tokens: int) -> None:
        nonlocal eval_seconds
        start = time.time()
        state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
        scorer.load_state_dict(state)                                    # copy_ casts: bf16-rounded float32
        result = evaluate(scorer, windows, cfg.eval_batch_size)
        key = selection_key(result)
        gate = result.exits.get("0.5", {})
        history["eval"].append({"step": step, "tokens": tokens, "loss_by_loops": [round(v, 5) for v in result.loss_by_loops],
                                "exit_0.5": {"mean_loops": round(gate.get("mean_loops", math.nan), 3),
                                             "loss": round(gate.get("loss", math.nan), 5)},
                                "rule": key[0], "seconds": round(time.time() - start, 2)})
        print(f"step {step}: held-out loss by loops {[round(v, 4) for v in result.loss_by_loops]}, q=0.5: "
              f"{gate.get('mean_loops', math.nan):.3f} loops, loss {gate.get('loss', math.nan):.4f}; "
              f"rule {key[0]}", flush=True)
        if not best or key < best["key"]:
            best.update(key=key, step=step, state=state, result=result)
        eval_seconds += time.time() - start

    evaluate_and_keep(0, 0)
    initial = history["eval"][0]
    step = tokens = window_steps = 0
    sums = torch.zeros(num_loops + 1, device=device)
    window_start = train_start = time.time()
    while (progress := budget.progress(step, tokens)) < 1.0:
        lr = learning_rate(cfg, step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        ids = next(batches)                                                   # [B, T]
        with autocast_for(device):
            out = model(ids, return_step_logits=True)
            objective = depth_objective(out.step_logits, out.exit_pdf, ids, loop_weights, cfg.gate_entropy_weight)
        objective.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del out                                                               # the [S, B, T, V] logits
        step, tokens, window_steps = step + 1, tokens + ids.numel(), window_steps + 1
        sums += torch.cat([objective.loss.detach()[None], objective.step_losses])
        if step == 1 or step % cfg.log_every == 0:
            means = (sums / window_steps).tolist()                            # host sync
            now = time.time()
            rate = window_steps * ids.numel() / (now - window_start)
            if step == 1:
                budget.clock_start, train_start, rate = now, now, 0.0           # warm-up excluded
            history["train"].append({"step": step, "tokens": tokens, "lr": lr, "tokens_per_s": round(rate),
                                     "objective": round(means[0], 4), "loss_by_loops": [round(v, 4) for v in means[1:]]})
            print(f"step {step}: lr {lr:.2e}, objective {means[0]:.4f}, train loss by loops "
                  f"{[round(v, 3) for v in means[1:]]}, {rate:,.0f} tokens/s", flush=True)
            if not all(map(math.isfinite, means)):
                print(f"loss is not finite at step {step}: stopping; the best evaluated weights are kept")
                break
            sums.zero_()
            window_steps, window_start = 0, now
        if step % cfg.eval_every == 0 and step >= cfg.eval_start:
            evaluate_and_keep(step, tokens)
            window_start += history["eval"][-1]["seconds"]                  # throughput of training only
    train_seconds = time.time() - train_start - (eval_seconds - history["eval"][0]["seconds"])
    if history["eval"][-1]["step"] != step:
        evaluate_and_keep(step, tokens)

    files = save_weights(best["state"], scorer, init, Path(cfg.out), cfg.shard_mb, cfg.weights_only)
    result = best["result"].as_json()
    report_dir = Path(cfg.report or cfg.out)
    report_dir.mkdir(parents=True, exist_ok=True)
    if cfg.throughput_batches:
        scorer.load_state_dict(best["state"])
        result["tokens_per_s_by_loops"] = throughput_by_loops(scorer, windows, cfg.eval_batch_size,
                                                              cfg.throughput_batches)
    report = {**result, "acceptance": acceptance(best["result"]), "selected_step": best["step"],
              "selection": SELECTION_RULES[best["key"][0]], "initial": initial,
              "steps": step, "tokens": tokens, "epochs": round(tokens / train_ids.numel(), 3),
              "train_seconds": round(train_seconds, 1),
              "tokens_per_s": round((tokens - cfg.batch_size * seq_len) / max(train_seconds, 1e-9)),
              "eval_seconds": round(eval_seconds, 1), "init": str(init),
              "init_weights_sha256": {p.name: sha256_file(p) for p in sorted(init.glob("*.safetensors"))},
              "weight_files": files, "train_tokens": train_ids.numel(), "tokens_manifest": {
                  k: manifest.get(k) for k in ("files", "tokenizer_sha256", "subset_of")},
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
              "torch": torch.__version__, "config": dataclasses.asdict(cfg), "history": history}
    write_json(report_dir / "finetune.json", report)
    if plot_depth(result, report_dir / "depth.png", title=f"{init.name}, fine-tuned (step {best['step']})"):
        report["depth_plot"] = "depth.png"
    report["wall_seconds"] = round(time.time() - T0, 1)
    write_json(report_dir / "finetune.json", report)
    summary = ("heldout_loss_by_loops", "exit_by_threshold", "acceptance", "selection", "selected_step", "steps",
               "tokens", "tokens_per_s", "train_seconds", "eval_seconds", "wall_seconds")
    print(json.dumps({k: report[k] for k in summary}))
    print(f"weights: {cfg.out} ({', '.join(files)})  report: {report_dir / 'finetune.json'}")
    return report


def save_weights(state: dict[str, torch.Tensor], model: torch.nn.Module, init: Path, out: Path, shard_mb: float,
                 weights_only: bool) -> dict[str, dict[str, Any]]:
    """Write `state` as bf16 safetensors into `out` (`zoo.save_pretrained`'s layout and shards),
    with `init`'s config and tokenizer files unless `weights_only` (then the shards alone, no index:
    the loader reads every *.safetensors of a folder). Reads the files back and checks that they
    hold exactly `state`. Returns {file: {bytes, sha256}}."""
    from safetensors.torch import load_file

    model.load_state_dict(state)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        zoo.save_pretrained(model, tmp, dtype=torch.bfloat16, max_shard_bytes=int(shard_mb * 1e6) or None)
        written = sorted(Path(tmp).glob("*.safetensors"))
        for old in out.glob("*.safetensors"):
            old.unlink()
        (out / "model.safetensors.index.json").unlink(missing_ok=True)
        names = [p.name for p in written] + ([] if weights_only else
                                             [p.name for p in Path(tmp).glob("*.index.json")])
        for name in names:
            shutil.move(str(Path(tmp) / name), out / name)
            (out / name).chmod(0o644)
    if not weights_only:
        for name in CHECKPOINT_FILES:
            shutil.copyfile(init / name, out / name)
    saved: dict[str, torch.Tensor] = {}
    for path in sorted(out.glob("*.safetensors")):
        saved.update(load_file(str(path)))
    for name, tensor in saved.items():
        if not torch.equal(tensor, state[name].cpu()):
            raise RuntimeError(f"{name} in {out} differs from the weights it should hold")
    return {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(out.glob("*.safetensors"))}


if __name__ == "__main__":
    finetune(parse_args())
