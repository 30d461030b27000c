"""Speculation passes captured as device graphs, as runtime/execution/graphs.py does for plain decode steps.

A draft pass (one row per request: prelude, `draft_loops` loops, head on every row) is the same
kernels for a given batch size, whatever the requests' depths and positions; so is the verify
pass of a uniform round (every request at K drafts and the same depth D: K + 1 rows each, loops
draft_loops..D-1, head). Each is captured once per batch bucket over static buffers and replayed
after refilling them; padding sequences own no blocks and write no KV. With capture off (the CPU)
the same padded path runs eagerly, so capture never changes a kernel's shapes or rounding.

All graphs share the Hal's pool and so must never replay at the same time: the async mode's
drafts on the side stream run eagerly (runtime/speculation/speculator.py).
"""
from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, NamedTuple, Sequence

import torch

from hal.base import MetaCapacity, PagedBatch
from hal.common.graph import EagerGraph
from runtime.execution.context import PagedContext
from runtime.engine.kv_cache import num_request_planes

log = logging.getLogger(__name__)


class _Captured(NamedTuple):
    graph: Any
    inputs: torch.Tensor               # draft: [1, B] token ids; verify: [1, N, X] draft states
    positions: torch.Tensor            # [1, B] / [1, N]
    init_state: torch.Tensor | None    # draft, Huginn: [1, B, D] initial states, drawn eagerly per replay
    ctx: PagedContext
    outputs: Any                       # draft: (state [1, B, X], logits [B, V]); verify: logits [N, V]


class SpecGraphs:
    def __init__(self, runner: Any, draft_loops: int, num_tokens: int) -> None:
        decode = runner.graphs                     # the plain decode graphs: buckets, capacity, capture
        self.runner, self.capture, self.buckets = runner, decode.capture, decode.buckets
        self.max_model_len, self.max_blocks = decode.max_model_len, decode.max_blocks
        self.draft_loops, self.num_tokens = draft_loops, num_tokens
        self.fixed = runner.kv_spec.num_fixed_planes
        self.captured: dict[tuple, _Captured] = {}

    def _bucket(self, num_seqs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    # ----- draft passes -----------------------------------------------------------------------
    def draft_pass(self, requests: Sequence[Any], ids: torch.Tensor, positions: Sequence[int],
                   tables: Sequence[Sequence[Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """State `[R, X]` after draft_loops loops and head logits `[R, V]` (float32) of one draft
        pass over `ids: [R]` at `positions`; both valid until the next replay of any graph."""
        num_seqs, planes = len(requests), self.fixed + self.draft_loops
        bucket = self._bucket(num_seqs)
        cap = self._get(("draft", bucket), lambda: self._capture_draft(bucket, planes))
        pad = bucket - num_seqs
        batch = PagedBatch([1] * bucket, [p + 1 for p in positions] + [1] * pad,
                           [[t[p] for t in tables] + [[]] * pad for p in range(planes)], self.runner.block_size)
        cap.inputs[0, :num_seqs].copy_(ids)
        cap.positions[0, :num_seqs].copy_(_long(positions, ids.device))
        if cap.init_state is not None:
            cap.init_state[:, :num_seqs].copy_(self._initial_states(requests))
        self._replay(cap, batch)
        state, logits = cap.outputs
        return state[0, :num_seqs], logits[:num_seqs]

    def _capture_draft(self, bucket: int, planes: int) -> _Captured:
        runner, model, device = self.runner, self.runner.model, self.runner.device
        ids = torch.zeros(1, bucket, dtype=torch.long, device=device)
        positions = torch.zeros(1, bucket, dtype=torch.long, device=device)
        init_state = init_fn = None
        if getattr(model, "initial_state", None) is not None:
            init_state = torch.zeros(1, bucket, model.config.n_embd, dtype=runner.dtype, device=device)
            init_fn = lambda e: init_state                                  # noqa: E731
        batch = PagedBatch([1] * bucket, [1] * bucket, [[[]] * bucket] * planes, runner.block_size)
        ctx = self._context(batch, MetaCapacity(bucket, bucket, self.max_blocks, planes, self.max_model_len),
                            positions, init_fn)

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            ctx.clear_cached()
            state = model.prelude(ids, ctx)
            for depth in range(self.draft_loops):
                state = model.loop(state, depth, ctx)
            return state, model.coda(state, ctx)[0].float()

        return self._record(step, ids, positions, init_state, ctx, batch, f"draft pass: batch {bucket}")

    def _initial_states(self, requests: Sequence[Any]) -> torch.Tensor:
        model, dtype = self.runner.model, self.runner.dtype
        like = torch.zeros(1, 1, model.config.n_embd, device=self.runner.device, dtype=dtype)
        return torch.cat([model.initial_state(like, init_scale=getattr(r.params, "init_scale", None),
                                              generator=r.generator) for r in requests], dim=1)

    # ----- verify passes ----------------------------------------------------------------------
    def can_verify(self, draft: Any) -> bool:
        """Whether the round is uniform: every request at K drafts and the same depth."""
        loops = draft.requests[0].num_loops
        return (len(draft.requests) <= self.buckets[-1] and all(k == self.num_tokens for k in draft.num_drafts)
                and all(r.num_loops == loops for r in draft.requests))

    def verify(self, draft: Any, tables: Sequence[Sequence[Sequence[int]]]) -> torch.Tensor:
        """Target logits `[N, V]` (float32) of a uniform round (`can_verify`), valid until the next replay."""
        num_seqs, width, loops = len(draft.requests), self.num_tokens + 1, draft.requests[0].num_loops
        bucket = self._bucket(num_seqs)
        planes = num_request_planes(self.runner.config.kv_mode, self.fixed, loops)
        cap = self._get(("verify", bucket, loops),
                        lambda: self._capture_verify(bucket, loops, planes, draft.states))
        pad = bucket - num_seqs
        batch = PagedBatch([width] * bucket, [s + width for s in draft.starts] + [width] * pad,
                           [[t[p] for t in tables] + [[]] * pad for p in range(planes)], self.runner.block_size)
        rows = num_seqs * width
        cap.inputs[0, :rows].copy_(draft.states.flatten(0, 1))
        positions = [s + j for s in draft.starts for j in range(width)]
        cap.positions[0, :rows].copy_(_long(positions, cap.positions.device))
        self._replay(cap, batch)
        return cap.outputs[:rows]

    def _capture_verify(self, bucket: int, loops: int, planes: int, like: torch.Tensor) -> _Captured:
        runner, model = self.runner, self.runner.model
        width = self.num_tokens + 1
        states = like.new_zeros(1, bucket * width, like.shape[-1])
        positions = torch.zeros(1, bucket * width, dtype=torch.long, device=runner.device)
        batch = PagedBatch([width] * bucket, [width] * bucket, [[[]] * bucket] * planes, runner.block_size)
        capacity = MetaCapacity(bucket, bucket * width, self.max_blocks, planes, self.max_model_len)
        ctx = self._context(batch, capacity, positions, None)

        def step() -> torch.Tensor:
            ctx.clear_cached()
            state = states
            for depth in range(self.draft_loops, loops):
                state = model.loop(state, depth, ctx)
            return model.coda(state, ctx)[0].float()

        what = f"verify pass: batch {bucket}, {loops} loops"
        return self._record(step, states, positions, None, ctx, batch, what)

    # ----- shared -----------------------------------------------------------------------------
    def _get(self, key: tuple, make: Callable[[], _Captured]) -> _Captured:
        if key not in self.captured:
            self.captured[key] = make()
        return self.captured[key]

    def _context(self, batch: PagedBatch, capacity: MetaCapacity, positions: torch.Tensor,
                 init_fn: Callable | None) -> PagedContext:
        runner = self.runner
        meta = runner.backend.build_meta(batch, capacity)
        return PagedContext(runner.backend, runner.kv_caches, batch, positions, runner.config.kv_mode, self.fixed,
                            init_fn, meta=meta)

    def _record(self, step: Callable[[], Any], inputs: torch.Tensor, positions: torch.Tensor,
                init_state: torch.Tensor | None, ctx: PagedContext, batch: PagedBatch, what: str) -> _Captured:
        runner = self.runner
        runner.backend.update_meta(ctx.meta, batch)
        with torch.inference_mode():
            step()                         # warm-up outside capture; an all-padding batch writes no KV
            runner.hal.synchronize()
            graph = runner.hal.graph() if self.capture else EagerGraph()
            outputs = graph.capture(step)
        log.info("captured a speculation graph: %s", what)
        return _Captured(graph, inputs, positions, init_state, ctx, outputs)

    def _replay(self, cap: _Captured, batch: PagedBatch) -> None:
        cap.graph.update(self.runner.backend.update_meta(cap.ctx.meta, batch))
        cap.graph.replay()


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
