"""Async scheduling's device side: a step whose sampled tokens stay on the device.

The engine launches step t+1 before it reads step t's tokens. Step t's tokens go to the host by an
asynchronous copy into page-locked memory plus an event (`PendingStep`), and step t+1 takes its
input tokens straight from step t's device tensor (`feed_tokens`), so no host sync sits between
the two launches. On the CPU every copy is immediate and the same code runs synchronously.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from hal.base import Hal
from runtime.engine.sequence import PLACEHOLDER


class StepResult(NamedTuple):
    sampled: dict[str, tuple[int, int]]     # request id -> (token, loops its logits came from)
    num_tokens: int                         # rows computed this step
    # requests that asked: request id -> its sampled token's logprobs (runtime/execution/logprobs.py)
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: dict[str, tuple[int, list]] | None = None   # request id -> (first prompt index, per token)


class Readback:
    """Two page-locked host buffers of `capacity` token ids, used in turn: the engine reads step t's
    buffer before it launches step t+2, which reuses it."""

    def __init__(self, hal: Hal, capacity: int) -> None:
        self.hal, self.capacity = hal, capacity
        self.buffers: list[torch.Tensor] | None = None
        self.turn = 0

    def start(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Queue the copy of `tokens: [R]` to host; returns (host view, event recorded after the copy)."""
        if self.buffers is None:
            self.buffers = [self.hal.host_tensor((self.capacity,), torch.long) for _ in range(2)]
        host = self.buffers[self.turn][:tokens.shape[0]]
        self.turn ^= 1
        host.copy_(tokens, non_blocking=True)
        event = self.hal.event()
        event.record()
        return host, event


class PendingStep:
    """A launched step: `tokens: [R]` (device, int64) are its sampled tokens in `request_ids` order."""

    def __init__(self, readback: Readback, tokens: torch.Tensor | None, request_ids: Sequence[str],
                 loops: Sequence[int], num_tokens: int, logprobs: Any = None) -> None:
        self.tokens, self.num_tokens = tokens, num_tokens
        self.logprobs = logprobs                 # a StepLogprobs on the device, read with the tokens
        self.request_ids, self.loops = list(request_ids), list(loops)
        self.row_of = {rid: i for i, rid in enumerate(self.request_ids)}
        self._host, self._event = readback.start(tokens) if tokens is not None else (None, None)

    def result(self) -> StepResult:
        """Wait for this step's copy only (later steps may still run) and return its tokens."""
        if self._host is None:
            logprobs, prompt = self.logprobs.to_host() if self.logprobs is not None else (None, None)
            return StepResult({}, self.num_tokens, logprobs, prompt)
        self._event.synchronize()
        # logprobs (only when a request asked): a plain device-to-host read, after this step's event
        logprobs, prompt = self.logprobs.to_host() if self.logprobs is not None else (None, None)
        values = self._host.tolist()
        sampled = {rid: (t, n) for rid, t, n in zip(self.request_ids, values, self.loops)}
        return StepResult(sampled, self.num_tokens, logprobs, prompt)


def feed_tokens(token_ids: list[int], fed: Sequence[tuple[int, str]], source: PendingStep | None,
                device: torch.device) -> torch.Tensor:
    """Token ids `[T]` on the device; each `(row, request id)` in `fed` is a placeholder that takes
    the token `source` sampled for that request, by a device-side copy."""
    if fed:
        if source is None or any(rid not in source.row_of for _, rid in fed):
            raise RuntimeError("a placeholder input token without the step that samples it "
                               "(an async scheduling bug)")
        token_ids = [0 if t == PLACEHOLDER else t for t in token_ids]
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    if fed:
        rows = torch.tensor([row for row, _ in fed], dtype=torch.long, device=device)
        src = torch.tensor([source.row_of[rid] for _, rid in fed], dtype=torch.long, device=device)
        ids.index_copy_(0, rows, source.tokens.index_select(0, src))
    return ids
