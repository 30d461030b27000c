"""A decode step's sampling tensors and stop checks from the persistent batch's row settings
(runtime/execution/row_params.py), with no loop over rows.

`RowSampling` mirrors the settings tables on the device and uploads them again only after a row
joined (their `version` moved). A step then costs one host-to-device copy, its rows and
positions through a pinned ring, from which the device gathers every row's settings (`StepRows`);
which sampling stages any row needs is numpy over the host tables. Rows whose logits need their own
history (penalties, logit bias) make the step take the per-row builder, `SamplingTensors.build`.

`StepRows.stop_codes` decides on the device, from each row's sampled token, whether the request
finishes: `CODE_STOPPED` (one of its stop tokens, once more than min_tokens outputs exist; the
sampler bans them before), `CODE_LENGTH` (max_tokens, or the context's end) or 0; the same rule as
`Request.check_stop`. The codes go to the host in the same copy as the tokens.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from hal.common.staging import StagingRing
from runtime.engine.sequence import CODE_LENGTH, CODE_STOPPED
from runtime.execution.row_params import (GREEDY, MAX_SEQ_LEN, MAX_TOKENS, MIN_P, MIN_TOKENS, NO_STOP_TOKEN,
                                          NUM_PROMPT, SEED, SEEDED, STOPS, TEMPERATURE, TOP_K, TOP_P, RowParams)
from runtime.execution.sampler import SamplingTensors


class StepRows:
    """The rows of one decode step: their settings gathered on the device, the host's flags."""

    def __init__(self, ints: torch.Tensor, floats: Callable[[], torch.Tensor], positions: torch.Tensor,
                 host_ints: np.ndarray, host_floats: np.ndarray, host_positions: np.ndarray, per_row: bool,
                 num_logprobs: np.ndarray, vocab_size: int) -> None:
        self.ints = ints                               # [R, C] int64 (row_params' columns)
        self._floats = floats                          # () -> [R, 3] float32, gathered only if a row samples
        self.positions = positions                     # [R] int64: each row's input token's position
        self.per_row = per_row                         # some row needs SamplingTensors.build
        self.num_logprobs = num_logprobs               # [R] host: top-k of logprobs each row wants, -1: none
        self.vocab_size = vocab_size
        sampled = host_ints[:, GREEDY] == 0
        seeded = host_ints[:, SEEDED] > 0
        top_k = host_ints[:, TOP_K]
        self.flags = dict(all_greedy=not sampled.any(),
                          any_top_k=bool(((top_k > 0) & (top_k < vocab_size)).any()),
                          any_top_p=bool((host_floats[:, TOP_P] < 1.0).any()),
                          any_min_p=bool((host_floats[:, MIN_P] > 0.0).any()), any_seeded=bool(seeded.any()),
                          any_unseeded=bool((sampled & ~seeded).any()))
        num_outputs = host_positions + 2 - host_ints[:, NUM_PROMPT]          # once this step's token is in
        has_stops = (host_ints[:, STOPS:] != NO_STOP_TOKEN).any(1)
        self.any_banned = bool(((num_outputs <= host_ints[:, MIN_TOKENS]) & has_stops).any())

    def num_outputs(self) -> torch.Tensor:
        """`[R]` the request's outputs once the token this step samples is one of them."""
        return self.positions + 2 - self.ints[:, NUM_PROMPT]

    def sampling_tensors(self) -> SamplingTensors:
        """The step's `SamplingTensors` (rows without `per_row` settings only)."""
        banned = None
        if self.any_banned:       # min_tokens: the row's stop tokens, as a mask (a [R, V] scatter, no host work)
            vocab, stops = self.vocab_size, self.ints[:, STOPS:]
            ban = (self.num_outputs() <= self.ints[:, MIN_TOKENS])[:, None] & (stops >= 0) & (stops < vocab)
            mask = torch.zeros(stops.shape[0], vocab + 1, dtype=torch.bool, device=stops.device)
            banned = mask.scatter_(1, torch.where(ban, stops, vocab), True)[:, :vocab]
        if self.flags["all_greedy"]:
            return SamplingTensors(None, None, None, None, None, None, None, None, banned, None, **self.flags)
        floats = self._floats()
        return SamplingTensors(temperature=floats[:, TEMPERATURE], greedy=self.ints[:, GREEDY] > 0,
                               top_k=self.ints[:, TOP_K], top_p=floats[:, TOP_P],
                               seeded=self.ints[:, SEEDED] > 0, seeds=self.ints[:, SEED],
                               positions=self.positions + 1, bias=None, banned=banned, penalties=None,
                               min_p=floats[:, MIN_P], **self.flags)

    def stop_codes(self, tokens: torch.Tensor) -> torch.Tensor:
        """`[R]` int64 finish codes of the rows that sampled `tokens: [R]`."""
        num_outputs = self.num_outputs()
        stopped = (self.ints[:, STOPS:] == tokens[:, None]).any(1) & (num_outputs > self.ints[:, MIN_TOKENS])
        length = (num_outputs >= self.ints[:, MAX_TOKENS]) | (self.positions + 2 >= self.ints[:, MAX_SEQ_LEN])
        return torch.where(stopped, CODE_STOPPED, length.long() * CODE_LENGTH)


class RowSampling:
    """The device's copy of the row settings, and each step's gather from it."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.device = device
        self.ints: torch.Tensor | None = None
        self.floats: torch.Tensor | None = None
        self._tables: StagingRing | None = None
        self._version = -1
        self._step_host = np.zeros((2, max_rows), dtype=np.int64)          # rows, positions
        self._step = torch.zeros(2, max_rows, dtype=torch.long, device=device)
        self._step_ring = StagingRing([self._step_host], device)
        self.num_uploads = 0              # host-to-device copies (tests check a step's count ignores the batch)

    def step(self, params: RowParams, rows: np.ndarray, positions: Any, vocab_size: int) -> StepRows:
        """The settings of rows `rows` (int64 `[R]`) whose input tokens sit at `positions` (`[R]`)."""
        if self._version != params.version:
            self._upload(params)
        num_rows = len(rows)
        positions = np.asarray(positions, dtype=np.int64)
        self._step_host[0, :num_rows], self._step_host[1, :num_rows] = rows, positions
        self._step_ring.stage([self._step_host], [self._step])
        self.num_uploads += 1
        index = self._step[0, :num_rows]
        floats = self.floats
        return StepRows(self.ints.index_select(0, index), lambda: floats.index_select(0, index),
                        self._step[1, :num_rows], params.ints[rows], params.floats[rows], positions,
                        bool(params.per_row[rows].any()), params.num_logprobs[rows], vocab_size)

    def _upload(self, params: RowParams) -> None:
        # whole tables (max_num_seqs rows, a few KiB), in steps where rows joined: one copy each
        floats = params.floats.astype(np.float32)
        if self.ints is None or tuple(self.ints.shape) != params.ints.shape:
            self.ints = torch.zeros(params.ints.shape, dtype=torch.long, device=self.device)
            self.floats = torch.zeros(floats.shape, dtype=torch.float32, device=self.device)
            self._tables = StagingRing([params.ints, floats], self.device)
        self._tables.stage([params.ints, floats], [self.ints, self.floats])
        self.num_uploads += 2
        self._version = params.version
