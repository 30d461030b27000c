"""Async scheduling's device side: a step whose sampled tokens stay on the device.

The engine launches step t+1 before it reads step t's tokens. Step t's tokens go to the host by an
asynchronous copy into page-locked memory plus an event (`PendingStep`), and step t+1 takes its
input tokens straight from step t's device tensor (`feed_tokens`), so no host sync sits between
the two launches. A decode step's finish codes (runtime/execution/row_sampling.py) ride in the same
copy as its tokens. On the CPU every copy is immediate and the same code runs synchronously.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from hal.base import Hal


class StepResult(NamedTuple):
    sampled: dict[str, tuple[int, int]]     # request id -> (token, loops its logits came from)
    num_tokens: int                         # rows computed this step
    # requests that asked: request id -> its sampled token's logprobs (runtime/execution/logprobs.py)
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: dict[str, tuple[int, list]] | None = None   # request id -> (first prompt index, per token)
    # a decode step over the persistent batch: request id -> its finish code (sequence.STATUS_OF_CODE)
    codes: dict[str, int] | None = None


def pack_step_values(tokens: torch.Tensor, codes: torch.Tensor | None,
                     loops: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """One `[R]`, `[2R]` or `[3R]` int64 tensor for one copy to host: the sampled tokens, then the
    finish codes where the step has them, then the loops where a captured pass chose them on the device."""
    parts = [t for t in (tokens, codes, loops if isinstance(loops, torch.Tensor) else None) if t is not None]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def unpack_step_values(values: list[int], request_ids: Sequence[str], has_codes: bool,
                       loops: Sequence[int] | None) -> tuple[list[int], dict[str, int] | None]:
    """(loops per request, finish codes or None) from `pack_step_values`'s values on the host;
    `loops` None: they travelled with the tokens."""
    n = len(request_ids)
    codes = dict(zip(request_ids, values[n:2 * n])) if has_codes else None
    return (values[len(values) - n:] if loops is None else list(loops)), codes


class Readback:
    """Two page-locked host buffers of `capacity` token ids, as many finish codes and as many loop
    counts, used in turn: the engine reads step t's buffer before it launches step t+2, which reuses it."""

    def __init__(self, hal: Hal, capacity: int) -> None:
        self.hal, self.capacity = hal, capacity
        self.buffers: list[torch.Tensor] | None = None
        self.turn = 0

    def start(self, tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Queue the copy of `tokens` (`[R]`, or up to `[3R]` with the finish codes and the loop counts)
        to host; returns (host view, event recorded after the copy)."""
        if self.buffers is None:
            self.buffers = [self.hal.host_tensor((3 * self.capacity,), torch.long) for _ in range(2)]
        host = self.buffers[self.turn][:tokens.shape[0]]
        self.turn ^= 1
        host.copy_(tokens, non_blocking=True)
        event = self.hal.event()
        event.record()
        return host, event


class PendingStep:
    """A launched step: `tokens: [R]` (device, int64) are its sampled tokens in `request_ids` order;
    `loops` the loops behind each: host ints, or `[R]` on the device (early exits a captured pass chose)."""

    def __init__(self, readback: Readback, tokens: torch.Tensor | None, request_ids: Sequence[str],
                 loops: Sequence[int] | torch.Tensor, num_tokens: int, logprobs: Any = None, rows: Any = None,
                 codes: torch.Tensor | None = None) -> None:
        self.tokens, self.num_tokens = tokens, num_tokens
        self.has_codes = codes is not None       # `[R]` finish codes, copied after the tokens
        self.rows = rows                         # persistent-batch rows of the requests (a decode step), or None
        self.logprobs = logprobs                 # a StepLogprobs on the device, read with the tokens
        self.request_ids = list(request_ids)
        # loops on the device travel with the tokens (None here), host ints stay here
        self.loops = None if isinstance(loops, torch.Tensor) else list(loops)
        self.row_of = {rid: i for i, rid in enumerate(self.request_ids)}
        self._host, self._event = (readback.start(pack_step_values(tokens, codes, loops)) if tokens is not None
                                   else (None, None))

    def result(self) -> StepResult:
        """Wait for this step's copy only (later steps may still run) and return its tokens."""
        if self._host is None:
            logprobs, prompt = self.logprobs.to_host() if self.logprobs is not None else (None, None)
            return StepResult({}, self.num_tokens, logprobs, prompt)
        self._event.synchronize()
        # logprobs (only when a request asked): a plain device-to-host read, after this step's event
        logprobs, prompt = self.logprobs.to_host() if self.logprobs is not None else (None, None)
        values = self._host.tolist()
        loops, codes = unpack_step_values(values, self.request_ids, self.has_codes, self.loops)
        sampled = {rid: (t, k) for rid, t, k in zip(self.request_ids, values, loops)}
        return StepResult(sampled, self.num_tokens, logprobs, prompt, codes)


def feed_tokens(token_ids: Sequence[int], fed: Sequence[tuple[int, str]], source: PendingStep | None,
                device: torch.device) -> torch.Tensor:
    """Token ids `[T]` on the device; each `(row, request id)` in `fed` is a placeholder that takes
    the token `source` sampled for that request, by a device-side copy. Every host value goes by
    non-blocking copies: a launch never waits for the step in flight."""
    ids = _to_device(token_ids, device)
    if fed:
        if source is None or any(rid not in source.row_of for _, rid in fed):
            raise RuntimeError("a placeholder input token without the step that samples it "
                               "(an async scheduling bug)")
        rows = _to_device([row for row, _ in fed], device)
        src = _to_device([source.row_of[rid] for _, rid in fed], device)
        ids.index_copy_(0, rows, source.tokens.index_select(0, src))
    return ids


def _to_device(values: Sequence[int], device: torch.device) -> torch.Tensor:
    host = torch.as_tensor(np.asarray(values, dtype=np.int64))
    return host.to(device, non_blocking=True) if device.type != "cpu" else host.clone()
