"""The one place a forward pass's inputs are made: token ids, positions, the host `PagedBatch`, the
attention metadata and the context, for every kind of pass (mixed prefill/decode steps, wavefront
segments, decode graphs, speculation drafts and verifies).

Each sequence's share of a pass is a `SeqSlice`. `describe` turns the slices into host lists
(`HostInputs`), `pad` adds the padding rows of a captured pass, and the result is placed on the
device either as fresh tensors with fresh metadata (`place`) or into a captured pass's static
buffers (`graphs.Captured.refill`). Everything else about a pass (which stages run) belongs to its caller.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from hal.base import AttentionBackend, PagedBatch
from runtime.engine.planes import PlaneLayout
from runtime.engine.sequence import PLACEHOLDER
from runtime.execution.context import PagedContext
from zoo.base import LoopedCausalLM, ModelOps


class PassEnv(NamedTuple):
    """What every pass of one runner shares: the model, its Hal's ops, the KV storage and layout."""

    model: LoopedCausalLM
    ops: ModelOps
    backend: AttentionBackend
    kv_caches: Sequence[torch.Tensor]          # one per layer slot of a plane, every block of the pool
    layout: PlaneLayout
    device: torch.device
    dtype: torch.dtype
    block_size: int
    scratch_block: int                         # first block past the pool: padding rows live there
    num_scratch_slots: int


class SeqSlice(NamedTuple):
    """One sequence's share of a pass: `num_tokens` tokens from position `start`."""

    request: Any                               # runtime.engine.sequence.Request; None for padding
    start: int
    num_tokens: int
    tables: Sequence[Sequence[int]]            # [plane][block] as this pass's planes see them


class HostInputs(NamedTuple):
    token_ids: list[int]                       # [T] (0 for padding); PLACEHOLDER: the device supplies it
    fed: list[tuple[int, str]]                 # (row, request id) of every PLACEHOLDER (async scheduling)
    positions: list[int]                       # [T]
    batch: PagedBatch
    draws: list[tuple[Any, int]]               # (request or None, rows): initial-state draws per sequence

    @property
    def num_seqs(self) -> int:
        return len(self.batch.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


class StepInputs(NamedTuple):
    ids: torch.Tensor                          # [1, T] int64
    positions: torch.Tensor                    # [1, T] int64
    ctx: PagedContext


def describe(slices: Sequence[SeqSlice], num_planes: int, block_size: int, with_tokens: bool = True) -> HostInputs:
    """Host inputs of a pass over `slices` (packed sequence after sequence); `with_tokens=False` for
    passes that start from states (the verify pass), whose token ids are not read."""
    token_ids, fed, positions, draws = [], [], [], []
    query_lens, seq_lens = [], []
    for s in slices:
        if with_tokens:
            ids = s.request.all_token_ids[s.start:s.start + s.num_tokens]
            if ids[-1] == PLACEHOLDER:         # async: only a request's newest token can be unknown
                fed.append((len(token_ids) + s.num_tokens - 1, s.request.request_id))
                ids = [*ids[:-1], 0]
            token_ids.extend(ids)
        positions.extend(range(s.start, s.start + s.num_tokens))
        query_lens.append(s.num_tokens)
        seq_lens.append(s.start + s.num_tokens)
        draws.append((s.request, s.num_tokens))
    by_plane = [[t[p] if p < len(t) else [] for t in (s.tables for s in slices)] for p in range(num_planes)]
    return HostInputs(token_ids, fed, positions, PagedBatch(query_lens, seq_lens, by_plane, block_size), draws)


def pad(host: HostInputs, num_seqs: int, width: int, env: PassEnv) -> HostInputs:
    """`host` padded to `num_seqs` sequences of `width` tokens each (a captured pass's fixed shape;
    the real sequences must already be `width` wide). Padding row r owns scratch slots
    `[r * width, (r + 1) * width)` past the pool: it touches nobody's KV, and no two rows write the
    same slot (some KV writes, Ascend's `npu_scatter_pa_kv_cache`, require unique slots per call)."""
    batch, bs = host.batch, env.block_size
    extra = range(host.num_seqs, num_seqs)
    assert num_seqs * width <= env.num_scratch_slots, "padding needs more scratch slots than the runner made"
    query_lens, seq_lens, tables, positions = list(batch.query_lens), list(batch.seq_lens), [], []
    for r in extra:
        first = r * width                                   # scratch slot of the row's first token
        start = first % bs
        query_lens.append(width)
        seq_lens.append(start + width)
        tables.append([env.scratch_block + b for b in range(first // bs, (first + width - 1) // bs + 1)])
        positions.extend(range(start, start + width))
    by_plane = [list(plane) + tables for plane in batch.block_tables]
    return HostInputs(host.token_ids + [0] * (len(extra) * width), host.fed, host.positions + positions,
                      PagedBatch(query_lens, seq_lens, by_plane, bs), host.draws + [(None, width)] * len(extra))


def place(env: PassEnv, host: HostInputs, fed_from: Any = None, ids: torch.Tensor | None = None) -> StepInputs:
    """Fresh device tensors and metadata for `host`. `fed_from` (an `async_step.PendingStep`) supplies
    the tokens `host.fed` names, by a device-side copy; `ids: [T]` (on the device) replaces the host's
    token ids altogether (speculation drafts from tokens it has not read back)."""
    from runtime.execution.async_step import feed_tokens

    if ids is None:
        ids = feed_tokens(host.token_ids, host.fed, fed_from, env.device)
    ids = ids[None]
    positions = torch.tensor(host.positions, dtype=torch.long, device=env.device)[None]
    return StepInputs(ids, positions, context(env, host, positions))


def context(env: PassEnv, host: HostInputs, positions: torch.Tensor, meta: Any = None,
            initial_state: torch.Tensor | None = None) -> PagedContext:
    """The attention context of a pass: fresh metadata for `host`, or a captured pass's `meta` and
    static `initial_state` buffer."""
    return PagedContext(env, host.batch, positions, host.draws, meta=meta, static_initial_state=initial_state)


def draw_initial_states(model: LoopedCausalLM, draws: Sequence[tuple[Any, int]], dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """Initial recurrent states `[1, sum(rows), D]`, each request's rows drawn with its own scale and
    generator (so a request's draw does not depend on the rest of the batch); padding rows get zeros."""
    width = model.initial_state_width
    parts = []
    for request, rows in draws:
        like = torch.zeros(1, rows, width, dtype=dtype, device=device)
        parts.append(like if request is None else
                     model.initial_state(like, request.params.init_scale, request.generator))
    return torch.cat(parts, dim=1)


def shifted_tables(tables: Sequence[Sequence[int]], num_fixed_planes: int, shift: int) -> Sequence[Sequence[int]]:
    """A request's tables `[plane][block]` as seen by a wavefront row at loop `shift` that the model
    runs as loop 0: loop plane `fixed + d` shows the blocks of plane `fixed + d + shift`."""
    if not shift:
        return tables
    return [tables[p] if p < num_fixed_planes else (tables[p + shift] if p + shift < len(tables) else [])
            for p in range(len(tables))]
