"""The optimiser side of `train_looped.py`: AdamW groups, warm-up + cosine learning rate, and the
training budget (steps, epochs, wall clock) that the schedule follows."""
from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from train_looped import TrainConfig


class Budget:
    """Training progress in [0, 1]: the furthest of steps, epochs and wall clock towards its limit.
    The clock starts after the first step, so compilation does not squeeze the schedule."""

    def __init__(self, cfg: TrainConfig, t_start: float, tokens_per_epoch: int) -> None:
        self.cfg, self.tokens_per_epoch = cfg, tokens_per_epoch
        self.deadline = t_start + cfg.max_minutes * 60 - cfg.reserve_seconds if cfg.max_minutes else None
        self.clock_start: float | None = None

    def progress(self, step: int, tokens: int) -> float:
        parts = [0.0]
        if self.cfg.max_steps:
            parts.append(step / self.cfg.max_steps)
        if self.cfg.max_epochs:
            parts.append(tokens / (self.cfg.max_epochs * self.tokens_per_epoch))
        if self.deadline is not None:
            now = time.time()
            if now >= self.deadline:
                return 1.0
            if self.clock_start is not None:
                parts.append((now - self.clock_start) / (self.deadline - self.clock_start))
        return min(1.0, max(parts))


def learning_rate(cfg: TrainConfig, step: int, progress: float) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """Weight decay on matrices only (not norms, gate bias)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
