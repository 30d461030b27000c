"""The persistent batch: the rows of decoding requests live across steps, so a decode step's host
work grows with what changed (requests joining or leaving, new KV blocks), not with the batch.

A request that decodes through a captured pass gets a row at its first such step and keeps it until
it finishes or loses its KV (`release`). Its block tables live in one int32 array `[P, rows, B]`
with their lengths `[P, rows]`, rewritten only for the requests the block manager reports as
changed (`BlockManager.changed`: a new block every `block_size` tokens, a trim, a fork, a free). A
step gathers the rows it runs with one vectorised index, and positions, sequence lengths and slot
mappings follow from arrays (`step_inputs.describe_rows`), never row by row. The request's
sampling settings and stop rules are written with its row too (`params`, runtime/execution/row_params.py).
`num_row_writes` counts the rows written one by one (tests check it does not grow with the batch).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from runtime.execution.row_params import RowParams


class InputBatch:
    def __init__(self, max_rows: int, max_planes: int, max_blocks: int) -> None:
        self.tables = np.zeros((max_planes, max_rows, max_blocks), dtype=np.int32)   # [P, rows, B]
        self.lengths = np.zeros((max_planes, max_rows), dtype=np.int32)              # [P, rows]
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))          # a stack: low rows first
        self.params = RowParams(max_rows)
        self.num_row_writes = 0

    @property
    def max_blocks(self) -> int:
        return self.tables.shape[2]

    def sync(self, blocks: Any) -> None:
        """Apply the block manager's changes since the last step: rows of requests whose tables
        changed are rewritten, rows of requests whose blocks were freed are released."""
        for request_id in blocks.changed:
            row = self.row_of.get(request_id)
            tables = blocks.tables.get(request_id)
            if row is not None and tables is None:
                self.release(request_id)                            # its blocks were freed
            elif row is not None:
                self._write(row, tables)
        blocks.changed.clear()

    def rows(self, requests: Sequence[Any], blocks: Any) -> np.ndarray:
        """The row of each of `requests` (int64 `[n]`); new requests get a row."""
        return np.fromiter((self._row(r, blocks) for r in requests), dtype=np.int64, count=len(requests))

    def release(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.lengths[:, row] = 0
            self.free_rows.append(row)

    def _row(self, request: Any, blocks: Any) -> int:
        row = self.row_of.get(request.request_id)
        if row is None:
            if not self.free_rows:
                raise RuntimeError("the persistent batch is full: more decoding requests than max_num_seqs")
            row = self.row_of[request.request_id] = self.free_rows.pop()
            self._write(row, blocks.tables[request.request_id])
            self.params.write(row, request)
        return row

    def _write(self, row: int, tables: Sequence[Sequence[int]]) -> None:
        self.num_row_writes += 1
        self.lengths[:, row] = 0
        for plane, table in enumerate(tables):
            if len(table) > self.max_blocks:
                raise ValueError(f"a block table of {len(table)} blocks exceeds the persistent batch's "
                                 f"{self.max_blocks} (max_model_len / block_size)")
            self.tables[plane, row, :len(table)] = table
            self.lengths[plane, row] = len(table)
