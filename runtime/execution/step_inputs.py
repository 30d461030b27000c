"""The one place a forward pass's inputs are made: token ids, positions, the host `PagedBatch`, the
attention metadata and the context, for every kind of pass (mixed prefill/decode steps, wavefront
segments, decode graphs, speculation drafts and verifies).

Each sequence's share of a pass is a `SeqSlice`. `describe` turns the slices into host lists
(`HostInputs`); a decode step over the persistent batch gets the same from arrays without a loop
over rows (`describe_rows`); `pad` adds the padding rows of a captured pass, and the result is placed on the
device either as fresh tensors with fresh metadata (`place`) or into a captured pass's static
buffers (`graphs.PassGraphs.run`). Everything else about a pass (which stages run) belongs to its caller.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from hal.attention import AttentionBackend, PagedBatch
from runtime.engine.planes import PlaneLayout
from runtime.engine.sequence import PLACEHOLDER
from runtime.execution.context import PagedContext
from runtime.execution.keyed_random import keyed_truncated_normals
from zoo.base import LoopedCausalLM
from zoo.context import ModelOps


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
    token_ids: Sequence[int]                   # [T] (0 for padding and for fed rows)
    fed: list[tuple[int, str]]                 # (row, request id) of every token the device supplies (async)
    positions: Sequence[int]                   # [T]
    batch: PagedBatch
    draws: list[tuple[Any, int]]               # (request or None, rows): initial-state draws per sequence
    rows: np.ndarray | None = None             # persistent-batch rows of the sequences (`describe_rows`)

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
    token_ids, fed, positions, draws = [], [], [], []         # positions: one array per slice
    query_lens, seq_lens = [], []
    for s in slices:
        if with_tokens:
            ids = s.request.token_ids(s.start, s.start + s.num_tokens)
            if ids[-1] == PLACEHOLDER:         # async: only a request's newest token can be unknown
                fed.append((len(token_ids) + s.num_tokens - 1, s.request.request_id))
                ids = [*ids[:-1], 0]
            token_ids.extend(ids)
        positions.append(np.arange(s.start, s.start + s.num_tokens, dtype=np.int64))
        query_lens.append(s.num_tokens)
        seq_lens.append(s.start + s.num_tokens)
        draws.append((s.request, s.num_tokens))
    by_plane = [[t[p] if p < len(t) else [] for t in (s.tables for s in slices)] for p in range(num_planes)]
    positions = np.concatenate(positions) if positions else np.zeros(0, dtype=np.int64)
    return HostInputs(token_ids, fed, positions, PagedBatch(query_lens, seq_lens, by_plane, block_size), draws)


def describe_rows(tables: np.ndarray, lengths: np.ndarray, rows: np.ndarray, requests: Sequence[Any],
                  num_planes: int, block_size: int) -> HostInputs:
    """Host inputs of a decode step (one token per request) whose block tables are rows `rows` of the
    persistent batch's arrays (`tables: [P, R, B]`, `lengths: [P, R]`): arrays, no loop over rows
    but the reads of each request's position and token."""
    from runtime.engine.sequence import PLACEHOLDER

    n = len(requests)
    positions = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=n)
    token_ids = np.fromiter((r.token_at(p) for r, p in zip(requests, positions.tolist())), dtype=np.int64, count=n)
    unknown = np.flatnonzero(token_ids == PLACEHOLDER).tolist()
    token_ids[unknown] = 0
    lengths = lengths[:num_planes, rows]
    width = max(int(lengths.max()), 1) if lengths.size else 1        # the longest table, not max_model_len's
    batch = PagedBatch(np.ones(n, dtype=np.int64), positions + 1, tables[:num_planes, rows, :width], block_size,
                       lengths)
    return HostInputs(token_ids, [(i, requests[i].request_id) for i in unknown], positions, batch,
                      [(r, 1) for r in requests], rows)


def planes_of(host: HostInputs, num_planes: int) -> HostInputs:
    """`host` seen through its first `num_planes` planes (a draft pass: the planes of its loops)."""
    batch = host.batch
    lengths = None if batch.table_lengths is None else batch.table_lengths[:num_planes]
    return host._replace(batch=batch._replace(block_tables=batch.block_tables[:num_planes], table_lengths=lengths))


def shifted(host: HostInputs, steps: int) -> HostInputs:
    """A decode pass (one token per sequence) `steps` positions on, same tables; no token ids (they
    come from the device: speculation's draft passes)."""
    positions = np.asarray(host.positions, dtype=np.int64) + steps
    return HostInputs([], [], positions, host.batch._replace(seq_lens=positions + 1), host.draws, host.rows)


def widened(host: HostInputs, width: int) -> HostInputs:
    """A decode pass's sequences, each `width` tokens from its position on, same tables; no token ids
    (a verify pass starts from states)."""
    start = np.asarray(host.positions, dtype=np.int64)
    n = len(start)
    return HostInputs([], [], (start[:, None] + np.arange(width)[None, :]).reshape(-1),
                      host.batch._replace(query_lens=np.full(n, width, dtype=np.int64), seq_lens=start + width),
                      [(r, width) for r, _ in host.draws], host.rows)


def pad(host: HostInputs, num_seqs: int, width: int, env: PassEnv) -> HostInputs:
    """`host` padded to `num_seqs` sequences of `width` tokens each (a captured pass's fixed shape;
    the real sequences must already be `width` wide), its tables as one array. Padding row r owns
    scratch slots `[r * width, (r + 1) * width)` past the pool: it touches nobody's KV, and no two
    rows write the same slot (some KV writes, Ascend's `npu_scatter_pa_kv_cache`, require unique
    slots per call)."""
    from hal.common.paged import block_table_array, table_lengths

    batch, bs = host.batch, env.block_size
    num_real, num_planes = host.num_seqs, len(batch.block_tables)
    assert num_seqs == num_real or num_seqs * width <= env.num_scratch_slots, \
        "padding needs more scratch slots than the runner made"
    pad_rows = np.arange(num_real, num_seqs, dtype=np.int64)
    first = pad_rows * width                                    # scratch slot of each padding row's first token
    starts = first % bs
    span = (width + bs - 1) // bs + 1                           # blocks a padding row's slots may cross
    pad_lengths = (first + width - 1) // bs - first // bs + 1                                   # [pad]
    pad_tables = env.scratch_block + first[:, None] // bs + np.arange(span)[None, :]          # [pad, span]
    # entries past a row's blocks stay inside the scratch blocks (a kernel may read whole tables)
    pad_tables = np.where(np.arange(span)[None, :] < pad_lengths[:, None], pad_tables, env.scratch_block)
    real = block_table_array(batch)                                                          # [P, n, B]
    width_blocks = max(real.shape[2], span)
    tables = np.zeros((num_planes, num_seqs, width_blocks), dtype=np.int32)
    tables[:, :num_real, :real.shape[2]] = real
    tables[:, num_real:, :span] = pad_tables[None]
    lengths = np.zeros((num_planes, num_seqs), dtype=np.int64)
    lengths[:, :num_real] = table_lengths(batch)
    lengths[:, num_real:] = pad_lengths[None]
    query_lens = np.concatenate([np.asarray(batch.query_lens, dtype=np.int64), np.full(len(pad_rows), width)])
    seq_lens = np.concatenate([np.asarray(batch.seq_lens, dtype=np.int64), starts + width])
    positions = np.concatenate([np.asarray(host.positions, dtype=np.int64),
                                (starts[:, None] + np.arange(width)[None, :]).reshape(-1)])
    token_ids = np.concatenate([np.asarray(host.token_ids, dtype=np.int64),
                                np.zeros(len(pad_rows) * width, dtype=np.int64)])
    return HostInputs(token_ids, host.fed, positions, PagedBatch(query_lens, seq_lens, tables, bs, lengths),
                      host.draws + [(None, width)] * len(pad_rows), host.rows)


def place(env: PassEnv, host: HostInputs, fed_from: Any = None, ids: torch.Tensor | None = None,
          capacity: Any = None) -> StepInputs:
    """Fresh device tensors and metadata for `host`. `fed_from` (an `async_step.PendingStep`) supplies
    the tokens `host.fed` names, by a device-side copy; `ids: [T]` (on the device) replaces the host's
    token ids altogether (speculation drafts from tokens it has not read back). `capacity` (a
    `MetaCapacity`): the metadata a pass captured within it would have (its kernels' configs)."""
    from runtime.execution.async_step import feed_tokens

    if ids is None:
        ids = feed_tokens(host.token_ids, host.fed, fed_from, env.device)
    ids = ids[None]
    positions = torch.as_tensor(np.asarray(host.positions, dtype=np.int64)).to(env.device, non_blocking=True)[None]
    meta = None if capacity is None else env.backend.build_meta(host.batch, capacity)
    return StepInputs(ids, positions, context(env, host, positions, meta=meta))


def context(env: PassEnv, host: HostInputs, positions: torch.Tensor, meta: Any = None,
            initial_state: torch.Tensor | None = None) -> PagedContext:
    """The attention context of a pass: fresh metadata for `host`, or a captured pass's `meta` and
    static `initial_state` buffer."""
    return PagedContext(env, host.batch, positions, host.draws, meta=meta, static_initial_state=initial_state)


def extend(host: HostInputs, num_tokens: int, env: PassEnv) -> HostInputs:
    """`host`'s one sequence lengthened to `num_tokens` query tokens (a captured prefill's fixed
    width). The extra tokens come after the real ones, so causal attention keeps them out of the
    real rows; past the sequence's blocks their tables continue in scratch blocks (the pass sees a
    whole sequence; nobody's KV is touched), and inside its last block they sit past its computed
    tokens, whose KV every later step rewrites before reading it. They draw no initial state: a
    request's random numbers stay those of its real tokens."""
    batch, bs = host.batch, env.block_size
    assert host.num_seqs == 1 and host.num_tokens <= num_tokens
    extra = num_tokens - host.num_tokens
    end = int(batch.seq_lens[0])
    need = -(-(end + extra) // bs)
    tables = [[list(plane[0]) + [env.scratch_block + j for j in range(max(0, need - len(plane[0])))]]
              for plane in batch.block_tables]
    # the runner allocates the scratch slots as whole blocks (rounded up), and the padding may use all of them
    assert need - len(batch.block_tables[0][0]) <= -(-env.num_scratch_slots // bs), "too few scratch blocks"
    return host._replace(token_ids=np.concatenate([np.asarray(host.token_ids, dtype=np.int64),
                                                   np.zeros(extra, dtype=np.int64)]),
                         positions=np.concatenate([np.asarray(host.positions, dtype=np.int64),
                                                   np.arange(end, end + extra, dtype=np.int64)]),
                         batch=batch._replace(query_lens=[num_tokens], seq_lens=[end + extra], block_tables=tables),
                         draws=host.draws + ([(None, extra)] if extra else []))


def draw_initial_states(model: LoopedCausalLM, draws: Sequence[tuple[Any, int]], dtype: torch.dtype,
                        device: torch.device, positions: Any) -> torch.Tensor:
    """Initial recurrent states `[1, sum(rows), D]` for the pass's `positions` (`[T]`, the draws'
    rows in order), each request's rows with its own scale: a seeded request's keyed by (seed,
    position), so they do not depend on the batch, the chunking or a recompute; an unseeded one's
    from its generator (the global RNG). Padding rows get zeros."""
    width = model.initial_state_width
    parts, start = [], 0
    for request, rows in draws:
        like = torch.zeros(1, rows, width, dtype=dtype, device=device)
        if request is None:
            parts.append(like)
        else:
            seed, scale = request.params.seed, request.params.init_scale
            noise = None
            if seed is not None and scale != 0:
                rows_at = positions.reshape(-1)[start:start + rows] if torch.is_tensor(positions) else \
                    torch.as_tensor(np.asarray(positions, dtype=np.int64).reshape(-1)[start:start + rows])
                noise = keyed_truncated_normals(seed, rows_at.to(device), width)
            parts.append(model.initial_state(like, scale, request.generator, noise=noise))
        start += rows
    return torch.cat(parts, dim=1)


def shifted_tables(tables: Sequence[Sequence[int]], num_fixed_planes: int, shift: int) -> Sequence[Sequence[int]]:
    """A request's tables `[plane][block]` as seen by a wavefront row at loop `shift` that the model
    runs as loop 0: loop plane `fixed + d` shows the blocks of plane `fixed + d + shift`."""
    if not shift:
        return tables
    return [tables[p] if p < num_fixed_planes else (tables[p + shift] if p + shift < len(tables) else [])
            for p in range(len(tables))]
