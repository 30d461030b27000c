"""Training helpers shared by the zoo's families: per-loop cross entropy, Ouro's expected-loss
objective with an entropy regulariser, and Huginn-style sampling of the loop count per batch.

Everything here is plain differentiable torch on the outputs of a model's `forward`, so it works
under autocast, `torch.compile`, DDP and FSDP like the rest of the model:

    out = model(ids, num_loops=sample_num_loops(4.0, generator=g), return_step_logits=True)
    objective = expected_exit_loss(out.step_logits, out.exit_pdf, ids, entropy_weight=0.05)
    objective.loss.backward()
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import torch
from torch import nn

IGNORE_INDEX = -100


class ExpectedExitLoss(NamedTuple):
    """Ouro's objective `sum_s p_s * CE_s - beta * H(p)`, averaged over the predicted tokens."""

    loss: torch.Tensor           # scalar: the objective to minimise
    step_losses: torch.Tensor    # [S] mean cross entropy of each loop's logits (no gradient)
    entropy: torch.Tensor        # scalar: mean entropy of the exit distribution (no gradient)


def step_cross_entropy(step_logits: torch.Tensor | Sequence[torch.Tensor], labels: torch.Tensor,
                       ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Per-token cross entropy of every loop's logits against the next token, in float32.

    `step_logits: [S, B, T, V]` (or a sequence of S tensors `[B, T, V]`, which avoids stacking
    the largest tensor of a training step), `labels: [B, T]` -> `[S, B, T - 1]`, where position t
    is scored against `labels[:, t + 1]`; ignored labels give 0.
    """
    targets = labels[:, 1:]                                                   # [B, T-1]
    losses = [nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), targets.flatten(),
                                          ignore_index=ignore_index, reduction="none").view_as(targets)
              for logits in step_logits]
    return torch.stack(losses)                                                # [S, B, T-1]


def exit_entropy(exit_pdf: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each token's exit distribution, `exit_pdf: [..., S]` -> `[...]`.
    Zero-probability steps contribute 0 (the limit of p log p), with a finite gradient."""
    p = exit_pdf.float()
    return -(p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))).sum(-1)


def expected_exit_loss(step_logits: torch.Tensor | Sequence[torch.Tensor], exit_pdf: torch.Tensor,
                       labels: torch.Tensor, entropy_weight: float = 0.05,
                       ignore_index: int = IGNORE_INDEX) -> ExpectedExitLoss:
    """The Ouro paper's training objective for a model with an exit gate.

    Per predicted token t: `sum_s p_s(t) * CE_s(t) - entropy_weight * H(p(t))`, then the mean over
    tokens whose label is not `ignore_index`. `p(t)` is the exit distribution at position t (the
    position whose logits predict `labels[t + 1]`). Gradients reach both the loops (through CE_s)
    and the gate (through p); the entropy term keeps the gate from collapsing onto one depth early.

    `step_logits: [S, B, T, V]` or S tensors `[B, T, V]`; `exit_pdf: [B, T, S]`; `labels: [B, T]`.
    """
    if exit_pdf is None:
        raise ValueError("expected_exit_loss needs an exit distribution; this model has no exit gate "
                         "(use the plain cross entropy of its logits instead)")
    ce = step_cross_entropy(step_logits, labels, ignore_index)                # [S, B, T-1]
    if ce.shape[0] != exit_pdf.shape[-1]:
        raise ValueError(f"{ce.shape[0]} loops of logits but an exit distribution over {exit_pdf.shape[-1]}")
    pdf = exit_pdf[:, :-1].float()                                            # [B, T-1, S]
    mask = (labels[:, 1:] != ignore_index).float()                            # [B, T-1]
    num_tokens = mask.sum().clamp_min(1.0)
    expected_ce = (pdf.permute(2, 0, 1) * ce).sum(0)                          # [B, T-1]
    entropy = exit_entropy(pdf)                                               # [B, T-1]
    loss = ((expected_ce - entropy_weight * entropy) * mask).sum() / num_tokens
    with torch.no_grad():
        step_losses = (ce * mask).sum((1, 2)) / num_tokens
        mean_entropy = (entropy * mask).sum() / num_tokens
    return ExpectedExitLoss(loss, step_losses, mean_entropy)


def sample_num_loops(mean_loops: float, sigma: float = 0.5, min_loops: int = 1, max_loops: int | None = None,
                     generator: torch.Generator | None = None) -> int:
    """A loop count for one batch, Huginn's way: Poisson with a log-normal rate.

    `tau ~ Normal(log(mean_loops - min_loops) - sigma^2 / 2, sigma)`, `r = min_loops + Poisson(e^tau)`,
    so `E[r] = mean_loops` (before clipping to `max_loops`) with a heavy right tail that trains the
    model for deeper recurrence than the mean. Draws on the CPU from `generator`, so every rank of a
    data-parallel job that seeds it alike picks the same count (ranks must agree: the graph differs).
    """
    if not mean_loops > min_loops >= 1:
        raise ValueError(f"need mean_loops > min_loops >= 1, got mean_loops={mean_loops}, min_loops={min_loops}")
    if max_loops is not None and max_loops < min_loops:
        raise ValueError(f"max_loops={max_loops} is below min_loops={min_loops}")
    mu = math.log(mean_loops - min_loops) - sigma * sigma / 2
    tau = torch.normal(torch.tensor([mu]), torch.tensor([sigma]), generator=generator)
    loops = min_loops + int(torch.poisson(tau.exp(), generator=generator).item())
    return loops if max_loops is None else min(loops, max_loops)
