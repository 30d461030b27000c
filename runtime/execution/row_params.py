"""The sampling settings and stop rules of the persistent batch's rows, kept as arrays.

Everything a decode row's sampler and stop check need that does not change while the request holds
its row (temperature, top-k, top-p, seed, its stop tokens, max_tokens, min_tokens, its prompt's
length, the context limit) is written here once, when the row joins (`InputBatch.rows`), and read
by row index afterwards (runtime/execution/row_sampling.py). What changes every step follows from
the step's positions, which the step has as an array anyway. `num_row_writes` counts the rows
written one by one, as `InputBatch.num_row_writes` does for block tables.

The integer table holds one row per batch row: the columns below, then the stop tokens padded with
-1 (never a token). It widens when a row joins with more stop tokens than any before it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

# columns of `RowParams.ints`; the stop tokens follow from STOPS on
TOP_K, SEED, SEEDED, GREEDY, NUM_PROMPT, MAX_TOKENS, MIN_TOKENS, MAX_SEQ_LEN, STOPS = range(9)
# columns of `RowParams.floats`
TEMPERATURE, TOP_P, MIN_P = range(3)
NO_STOP_TOKEN = -1


class RowParams:
    def __init__(self, max_rows: int) -> None:
        self.ints = np.zeros((max_rows, STOPS + 1), dtype=np.int64)
        self.ints[:, STOPS:] = NO_STOP_TOKEN
        # float64: the host's flags compare the request's own values (as the per-row builder does);
        # the device gets them as float32, the rounding the per-row builder's tensors have
        self.floats = np.ones((max_rows, 3), dtype=np.float64)
        self.floats[:, MIN_P] = 0.0                                # off (temperature and top_p: 1.0)
        self.per_row = np.zeros(max_rows, dtype=bool)              # logits need the row's history (penalties, bias)
        self.num_logprobs = np.full(max_rows, -1, dtype=np.int64)  # top-k of sampled-token logprobs; -1: none
        self.version = 0                  # bumped by every write: the device mirror re-uploads when it moved
        self.num_row_writes = 0

    @property
    def num_stop_columns(self) -> int:
        return self.ints.shape[1] - STOPS

    def write(self, row: int, request: Any) -> None:
        """Row `row` now belongs to `request` (a runtime.engine.sequence.Request)."""
        self.num_row_writes += 1
        self.version += 1
        p = request.params
        sampled = not p.is_greedy
        seeded = sampled and p.seed is not None
        stops = sorted(set(request.stop_token_ids) | set(p.stop_token_ids))
        if len(stops) > self.num_stop_columns:
            wider = np.full((self.ints.shape[0], STOPS + len(stops)), NO_STOP_TOKEN, dtype=np.int64)
            wider[:, :self.ints.shape[1]] = self.ints
            self.ints = wider
        self.ints[row] = NO_STOP_TOKEN
        self.ints[row, :STOPS] = (p.top_k if sampled else 0, p.seed if seeded else 0, seeded, not sampled,
                                  len(request.prompt_token_ids), p.max_tokens, p.min_tokens, request.max_seq_len)
        self.ints[row, STOPS:STOPS + len(stops)] = stops
        self.floats[row] = (p.temperature if sampled else 1.0, p.top_p if sampled else 1.0,
                            p.min_p if sampled else 0.0)
        self.per_row[row] = p.has_penalties or bool(p.logit_bias)
        k = request.num_logprobs
        self.num_logprobs[row] = -1 if k is None else k
