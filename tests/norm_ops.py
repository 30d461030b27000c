"""Counting a forward's norm and residual-add launches on CPU: a Hal with the norm ops as torch
expressions, the residual-stream adds the model runs as torch ops, and the counts Huginn and
Nanbeige should show without and with `norm_add_norm`."""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hal.cpu import CpuHal


class StreamAdds(TorchDispatchMode):
    """Inside `with StreamAdds(width) as adds:`, `adds.count` counts the residual-stream adds a
    forward runs as torch ops (each its own launch on a GPU): `aten.add` of two tensors of one shape
    with last dim `width`, the hidden size (rotary, bias and attention adds have other shapes), but
    not inside `paused()`: a Hal's fused op, whose add is in its kernel."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.count, self.is_paused = width, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        a, b = (*args, None, None)[:2]
        if (func is torch.ops.aten.add.Tensor and not self.is_paused and isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor) and a.shape == b.shape and a.shape[-1] == self.width):
            self.count += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        before, self.is_paused = self.is_paused, True
        try:
            yield
        finally:
            self.is_paused = before


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class NormOpsCpu(CpuHal):
    """The CPU Hal offering `names` of `rms_norm` and `norm_add_norm` as the RMSNorm expressions of
    zoo/layers.py, counting their calls in `calls`; `adds` (if given) does not count their adds."""

    def __init__(self, names: tuple[str, ...] = ("rms_norm", "norm_add_norm"),
                 adds: StreamAdds | None = None) -> None:
        super().__init__()
        self.names, self.adds, self.calls = names, adds, collections.Counter()

    def op(self, name: str) -> Any:
        return getattr(self, name) if name in self.names else None

    def _op(self, name: str) -> Any:
        self.calls[name] += 1
        return self.adds.paused() if self.adds is not None else contextlib.nullcontext()

    def rms_norm(self, x, weight, eps, residual=None):
        with self._op("rms_norm"):
            y = _rms_norm(x, weight, eps)
            return y if residual is None else residual + y

    def norm_add_norm(self, x, residual, post_weight, weight, eps, sum_first=False):
        with self._op("norm_add_norm"):
            if post_weight is None:
                h = residual + x
            elif sum_first:
                h = _rms_norm(x + residual, post_weight, eps)
            else:
                h = residual + _rms_norm(x, post_weight, eps)
            return _rms_norm(h, weight, eps), h


def huginn_launches(config: Any, loops: int, coda_calls: int) -> dict[str, dict[str, int]]:
    """Huginn's norm calls and stream adds in a forward without ("unfused") and with `norm_add_norm`
    ("fused"), from its block counts: per block 4 norms and 2 adds, where fused 2 norm_add_norm, less
    at a run's edges: each run's first n1 alone, the prelude's and a core loop's last add and n4 too
    (the concat and the adapter follow), ln_f twice per coda (before it and fused into its last block).
    Each loop also adds the adapter's prelude half c to its state half (`s @ W_s^T + c`; in the
    projection's epilogue where the Hal has `linear`, which these counts leave out)."""
    prelude, core = config.n_layers_in_prelude, config.n_layers_in_recurrent_block
    coda = config.n_layers_in_coda
    return {"unfused": {"rms_norm": 4 * prelude + 4 * core * loops + (4 * coda + 2) * coda_calls,
                        "add": 2 * prelude + (2 * core + 1) * loops + 2 * coda * coda_calls},
            "fused": {"rms_norm": 2 + 2 * loops + 2 * coda_calls,
                      "norm_add_norm": 2 * prelude - 1 + (2 * core - 1) * loops + 2 * coda * coda_calls,
                      "add": 1 + 2 * loops}}


def nanbeige_launches(config: Any, loops: int) -> dict[str, dict[str, int]]:
    """Nanbeige's (pre-norm) norm calls and stream adds without and with `norm_add_norm`: per layer
    2 adds and 2 norms, where fused 2 norm_add_norm, plus per loop the final norm (fused into the
    last layer) and the first layer's input norm (alone)."""
    layers = config.num_hidden_layers
    return {"unfused": {"rms_norm": (2 * layers + 1) * loops, "add": 2 * layers * loops},
            "fused": {"rms_norm": loops, "norm_add_norm": 2 * layers * loops, "add": 0}}
