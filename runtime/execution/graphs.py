"""Decode steps captured as device graphs, one per batch-size bucket and loop count.

A pure decode step (every request computes one token and samples it, all at the same depth, no
early exit) is the same sequence of kernels for a given batch size: prelude, every loop, the head.
With graphs off the same padded path runs eagerly, so turning graphs on or off never changes a
kernel's shapes (and so never its rounding): only whether the work was captured.
It is captured once per bucket over static buffers (token ids, positions, attention metadata with
a fixed capacity, Huginn's initial states) and replayed after refilling them; batches are padded
up to the bucket with dummy sequences in scratch blocks past the pool. Hals whose kernels take
lengths as host values (Ascend) get them through `Graph.update` before each replay.
"""
from __future__ import annotations

import bisect
import logging
import math
from typing import Any, NamedTuple, Sequence

import torch

from hal.base import MetaCapacity, PagedBatch
from hal.common.graph import EagerGraph
from runtime.execution.context import PagedContext
from runtime.engine.kv_cache import BlockManager, num_request_planes
from runtime.engine.scheduler import ScheduledRequest

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)


class _Captured(NamedTuple):
    graph: Any                   # keeps the captured function, and so every static tensor, alive
    ids: torch.Tensor            # [1, B] token ids
    positions: torch.Tensor      # [1, B]
    init_state: torch.Tensor | None   # [1, B, D] Huginn's initial states, drawn eagerly per replay
    ctx: PagedContext
    logits: torch.Tensor         # [B, V] float32, overwritten by every replay


class DecodeGraphs:
    def __init__(self, runner: Any, max_num_seqs: int, max_model_len: int, capture: bool = True,
                 num_copies: int = 1) -> None:
        self.runner = runner
        self.capture = capture           # False: the same padded static-buffer path, run eagerly
        # async scheduling refills a graph's inputs while the previous step may still run: two
        # copies of each graph, used in turn, so that never touches the replay in flight
        self.num_copies, self.num_runs = num_copies, 0
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.max_model_len = max_model_len
        self.max_blocks = math.ceil(max_model_len / runner.block_size)
        self.graphs: dict[tuple[int, int, int], _Captured] = {}

    def eligible(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        if not scheduled or len(scheduled) > self.buckets[-1]:
            return False
        loops = scheduled[0].request.num_loops
        for item in scheduled:
            req = item.request
            if not (item.num_tokens == 1 and item.samples and req.num_loops == loops and req.exit_threshold >= 1.0):
                return False
        return True

    def run(self, scheduled: Sequence[ScheduledRequest], blocks: BlockManager,
            input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[len(scheduled), V]` (float32) of one decode step, by graph replay. `input_ids: [B]`
        (device) replaces the requests' host token ids (async scheduling feeds them device-side)."""
        num_seqs = len(scheduled)
        bucket = self.buckets[bisect.bisect_left(self.buckets, num_seqs)]
        loops = scheduled[0].request.num_loops
        key = (bucket, loops, self.num_runs % self.num_copies)
        self.num_runs += 1
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, loops)
        batch = self._batch(scheduled, blocks, bucket, scheduled[0].request.num_planes)
        cap = self.graphs[key]
        ids = [item.request.all_token_ids[item.request.num_computed_tokens] for item in scheduled]
        positions = [item.request.num_computed_tokens for item in scheduled]
        cap.ids[0, :num_seqs].copy_(torch.tensor(ids) if input_ids is None else input_ids, non_blocking=True)
        cap.positions[0, :num_seqs].copy_(torch.tensor(positions), non_blocking=True)
        if cap.init_state is not None:
            cap.init_state[:, :num_seqs].copy_(self._initial_states(scheduled))
        host_params = self.runner.backend.update_meta(cap.ctx.meta, batch)
        cap.graph.update(host_params)
        cap.graph.replay()
        return cap.logits[:num_seqs]

    def _batch(self, scheduled: Sequence[ScheduledRequest], blocks: BlockManager | None, bucket: int,
               num_planes: int) -> PagedBatch:
        """The step's batch padded to `bucket` sequences. Padding row r is a sequence of r % block_size + 1
        tokens in scratch block r // block_size (past the pool): it touches nobody's KV, and no two rows
        write the same slot."""
        query_lens = [1] * bucket
        bs, pad_rows = self.runner.block_size, range(len(scheduled), bucket)
        seq_lens = [item.request.num_computed_tokens + 1 for item in scheduled]
        seq_lens += [r % bs + 1 for r in pad_rows]
        tables = [blocks.block_tables(item.request.request_id) for item in scheduled] if scheduled else []
        pad = [[self.runner.scratch_block + r // bs] for r in pad_rows]
        by_plane = [[t[p] for t in tables] + pad for p in range(num_planes)]
        return PagedBatch(query_lens, seq_lens, by_plane, self.runner.block_size)

    def _initial_states(self, scheduled: Sequence[ScheduledRequest]) -> torch.Tensor:
        model, dtype = self.runner.model, self.runner.dtype
        like = torch.zeros(1, 1, model.config.n_embd, device=self.runner.device, dtype=dtype)
        return torch.cat([model.initial_state(like, init_scale=getattr(i.request.params, "init_scale", None),
                                              generator=i.request.generator) for i in scheduled], dim=1)

    def _capture(self, bucket: int, loops: int) -> _Captured:
        runner, model, device = self.runner, self.runner.model, self.runner.device
        planes = num_request_planes(runner.config.kv_mode, runner.kv_spec.num_fixed_planes, loops)
        batch = self._batch([], None, bucket, planes)     # all padding: capture touches only the scratch block
        capacity = MetaCapacity(bucket, bucket, self.max_blocks, planes, self.max_model_len)
        meta = runner.backend.build_meta(batch, capacity)
        ids = torch.zeros(1, bucket, dtype=torch.long, device=device)
        positions = torch.zeros(1, bucket, dtype=torch.long, device=device)
        init_state = None
        init_fn = None
        if getattr(model, "initial_state", None) is not None:
            init_state = torch.zeros(1, bucket, model.config.n_embd, dtype=runner.dtype, device=device)
            init_fn = lambda e: init_state                                  # noqa: E731
        ctx = PagedContext(runner.backend, runner.kv_caches, batch, positions, runner.config.kv_mode,
                           runner.kv_spec.num_fixed_planes, init_fn, meta=meta)
        rows = torch.arange(bucket, device=device)

        def step() -> torch.Tensor:
            ctx.clear_cached()
            state = model.prelude(ids, ctx)
            for depth in range(loops):
                state = model.loop(state, depth, ctx)
            return model.coda(state, ctx, rows=rows)[0].float()

        runner.backend.update_meta(meta, batch)
        with torch.inference_mode():
            step()                         # warm-up: kernel compilation and library handles, outside capture
            runner.hal.synchronize()
            graph = runner.hal.graph() if self.capture else EagerGraph()
            logits = graph.capture(step)
        log.info("captured a decode graph: batch %d, %d loops", bucket, loops)
        return _Captured(graph, ids, positions, init_state, ctx, logits)
