"""Log-probabilities of a step, computed on the device from logits the step has anyway.

- Sampled tokens (`SamplingParams.logprobs`, and `best_of`, which ranks samples by them): from the
  logits each token was sampled from (the exit loop's under early exit).
- Prompt tokens (`prompt_logprobs`): the logits of a packed row at position p predict the prompt
  token at p + 1. The runner asks the model's coda for those rows when a request of the step wants
  them (`prompt_rows`, then `prompt_logits`): the coda is applied to the final loop's state of the
  chunk's rows, the same state its last row's logits come from. A prefix-cache hit would skip
  computing prompt rows, so such requests are never served from the cache (runtime/engine/scheduler.py).

Everything stays on the device until `StepLogprobs.to_host`, one copy with the step's tokens.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from runtime.engine.outputs import TokenLogprobs
from runtime.execution.sampler import LogprobsTensors, compute_logprobs


class PromptRows(NamedTuple):
    """Packed rows of a step whose logits give prompt logprobs."""

    rows: list[int]                          # packed rows, in order
    targets: list[int]                       # the prompt token each row predicts
    spans: list[tuple[str, int, int, int]]   # (request id, first prompt index, count, k) per request


def prompt_rows(scheduled: Sequence[Any]) -> PromptRows | None:
    """The rows of a standard step (items packed in order) that predict a prompt token of a request
    with `prompt_logprobs`; None when no request of the step wants any."""
    rows, targets, spans, offset = [], [], [], 0
    for item in scheduled:
        req, n = item.request, item.num_tokens
        k = req.params.prompt_logprobs
        start = req.num_computed_tokens
        # positions start .. start+n-1 predict tokens start+1 .. start+n; keep those in the prompt
        end = min(start + n, len(req.prompt_token_ids) - 1)
        if k is not None and end > start:
            rows.extend(range(offset, offset + end - start))
            targets.extend(req.prompt_token_ids[start + 1:end + 1])
            spans.append((req.request_id, start + 1, end - start, k))
        offset += n
    return PromptRows(rows, targets, spans) if rows else None


def prompt_logits(model: Any, state: torch.Tensor, ctx: Any, rows: PromptRows) -> torch.Tensor:
    """Logits `[P, V]` (float32) of `rows` from the final loop's packed `state: [1, T, X]`."""
    index = torch.tensor(rows.rows, dtype=torch.long).to(state.device, non_blocking=True)
    return model.coda(state, ctx, rows=index)[0].float()


class StepLogprobs(NamedTuple):
    """A step's log-probabilities on the device, with what says whose they are."""

    sampled: LogprobsTensors | None
    sampled_ids: list[str]                       # request of each sampled row
    sampled_ks: list[int]                        # top-k each asked for
    prompt: LogprobsTensors | None
    prompt_spans: list[tuple[str, int, int, int]]

    @classmethod
    def compute(cls, logits: torch.Tensor | None, tokens: torch.Tensor | None, requests: Sequence[Any],
                prompt: tuple[PromptRows, torch.Tensor] | None,
                ks: np.ndarray | None = None) -> "StepLogprobs | None":
        """From the step's sampling `logits: [R, V]`, its sampled `tokens: [R]` (rows of `requests`)
        and, for prompt logprobs, `(rows, their logits [P, V])`. None when nobody asked. `ks`: each
        row's top-k (-1: none) as an array (a persistent batch's rows: no loop over the rows that did
        not ask)."""
        if ks is not None:
            wanted = np.flatnonzero(ks >= 0).tolist()
        else:
            wanted = [i for i, r in enumerate(requests) if _num_logprobs(r) is not None]
        sampled = None
        if wanted:
            index = torch.tensor(wanted, dtype=torch.long).to(logits.device, non_blocking=True)
            k = max(_num_logprobs(requests[i]) for i in wanted)
            sampled = compute_logprobs(logits.index_select(0, index), tokens.index_select(0, index), k)
        prompt_lp, spans = None, []
        if prompt is not None:
            rows, values = prompt
            targets = torch.tensor(rows.targets, dtype=torch.long).to(values.device, non_blocking=True)
            prompt_lp, spans = compute_logprobs(values, targets, max(k for *_, k in rows.spans)), rows.spans
        if sampled is None and prompt_lp is None:
            return None
        return cls(sampled, [requests[i].request_id for i in wanted],
                   [_num_logprobs(requests[i]) for i in wanted], prompt_lp, spans)

    def to_host(self) -> tuple[dict[str, TokenLogprobs], dict[str, tuple[int, list[TokenLogprobs]]]]:
        """({request id: its sampled token's logprobs}, {request id: (first prompt index, per token)})."""
        sampled = {}
        if self.sampled is not None:
            sampled = dict(zip(self.sampled_ids, self.sampled.to_host(self.sampled_ks)))
        prompt = {}
        if self.prompt is not None:
            ks = [k for _, _, count, k in self.prompt_spans for _ in range(count)]
            values, at = self.prompt.to_host(ks), 0
            for rid, first, count, _ in self.prompt_spans:
                prompt[rid] = (first, values[at:at + count])
                at += count
        return sampled, prompt


def _num_logprobs(request: Any) -> int | None:
    """Top-k a request wants for its sampled tokens (0: only the token's own), or None."""
    return request.num_logprobs
