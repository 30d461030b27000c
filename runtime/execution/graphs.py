"""Forward passes captured as device graphs: one capture and one replay routine for every kind of
pass (plain decode steps, speculation drafts and verifies).

A pass whose sequences all have the same width (tokens per sequence) and run the same stages is
the same sequence of kernels for a given number of sequences. It is captured once per batch-size
bucket over static buffers (inputs, positions, attention metadata with a fixed capacity, Huginn's
initial states), at the engine's start for the passes it expects (`ModelRunner.capture_at_start`)
or on first use, and replayed after refilling them; batches are padded up to the bucket with
sequences in scratch slots past the pool (`step_inputs.pad`). Hals whose kernels take lengths as
host values (Ascend) get them through `Graph.update` before each replay. With capture off (the CPU)
the same padded path runs eagerly, so turning graphs on or off never changes a kernel's shapes (and
so never its rounding): only whether the work was captured.

All graphs share the Hal's memory pool and so must never replay at the same time.
"""
from __future__ import annotations

import bisect
import logging
import math
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from hal.attention import MetaCapacity
from hal.base import Hal
from hal.common.graph import EagerGraph
from hal.common.staging import StagingRing
from runtime.execution.context import PagedContext
from runtime.execution.step_inputs import HostInputs, PassEnv, context, draw_initial_states, pad

log = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)

# program(inputs, ctx) -> outputs: a pass's stages over static inputs ([1, N] ids or [1, N, X] states)
Program = Callable[[torch.Tensor, PagedContext], Any]


class Captured(NamedTuple):
    graph: Any                          # keeps the captured function, and so every static tensor, alive
    inputs: torch.Tensor                # [1, N] token ids, or [1, N, X] states
    positions: torch.Tensor             # [1, N]
    initial_state: torch.Tensor | None  # [1, N, D] Huginn's initial states, drawn eagerly per replay
    ctx: PagedContext
    outputs: Any                        # overwritten in place by every replay
    fed_from: torch.Tensor              # [N] int64: where each row's token is in the previous step's (-1: host)
    staging: StagingRing                # pinned host mirrors of the host-written inputs (no blocking copies)


class Chain(NamedTuple):
    """A captured chain of passes (`PassGraphs.run_chain`): one graph, one context per pass."""

    graph: Any
    host_ints: torch.Tensor             # [n0 + sum(n_j)] int64: the first pass's token ids, then each pass's positions
    initial_states: list                # per pass: [1, n_j, D] Huginn's initial states (passes that run the prelude)
    ctxs: list                          # per pass: PagedContext over a static meta
    outputs: Any
    staging: StagingRing


class PassGraphs:
    """Captured passes keyed by what makes their kernels differ (kind, bucket, depth, copy)."""

    def __init__(self, env: PassEnv, hal: Hal, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        self.env, self.hal = env, hal
        self.capture = capture          # False: the same padded static-buffer path, run eagerly
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.max_model_len = max_model_len
        self.max_blocks = math.ceil(max_model_len / env.block_size)
        self.captured: dict[tuple, Captured] = {}
        self.chains: dict[tuple, Chain] = {}

    def max_blocks_of(self, width: int, context: bool = True) -> int:
        """Block-table width of a pass of `width` tokens per sequence: a sequence padded to the width
        (`step_inputs.extend`: a prompt's last chunk, up to a bucket) may reach `width - 1` tokens past
        max_model_len, and an all-padding row's slots may straddle one more block. Without `context`
        (a prompt's only chunk) a sequence holds just its own tokens: the width's blocks and that one
        more, however long max_model_len is (a backend may do work per table entry: Ascend's int8
        prefill dequantizes every block its tables name)."""
        own = -(-width // self.env.block_size) + 1
        if width == 1:
            return self.max_blocks
        return self.max_blocks + own if context else own

    def capacity_of(self, bucket: int, width: int, num_planes: int, context: bool = True,
                    fresh: bool = False) -> MetaCapacity:
        """The metadata capacity of a pass of `bucket` sequences of `width` tokens (`max_blocks_of`):
        a padding row starts inside a scratch block (`step_inputs.pad`), so it may reach a block past
        its width even where max_model_len is shorter than a block."""
        reach = max(self.max_model_len, self.env.block_size) if context else self.env.block_size
        longest = reach + width - 1
        return MetaCapacity(bucket, bucket * width, self.max_blocks_of(width, context), num_planes, longest, fresh,
                            context)

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs` sequences (None: too many to capture)."""
        if not 0 < num_seqs <= self.buckets[-1]:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def run(self, key: tuple, program: Program, host: HostInputs, width: int, num_planes: int,
            inputs: torch.Tensor | None = None, state_width: int | None = None, fed_from: Any = None,
            fresh: bool = False, context: bool = True) -> Any:
        """Replay (capturing on first use) the pass `key` over `host` (sequences of `width` tokens),
        padded to its bucket. `inputs`: the real rows' ids `[n]` or states `[n, X]` on the device;
        None takes the ids from `host`, where `host.fed` rows take theirs from `fed_from` (a
        `PendingStep`: async scheduling) on the device. `state_width`: X for passes that start from
        states. `fresh`: every batch this key replays is prefills without prior context (the
        backend may capture its fresh attention path; `MetaCapacity.fresh`); without `context` they
        are prompts' only chunks (the tables' capacity is the width's; `max_blocks_of`). Host values reach the
        device through pinned mirrors: the host never waits here."""
        bucket = self.bucket(host.num_seqs)
        full = pad(host, bucket, width, self.env)
        # a pass wider than the scratch slots (a long prompt) is captured over its own first batch:
        # the warm-up writes the slots the replay then rewrites, before anything reads them
        over = full if bucket * width > self.env.num_scratch_slots else None
        cap = self.prepare(key, program, bucket, width, num_planes, state_width, fresh, context, over)
        return self._replay(cap, host, full, inputs, fed_from)

    def run_packed(self, key: tuple, program: Program, host: HostInputs, full: HostInputs,
                   capacity: MetaCapacity, fed_from: Any = None) -> Any:
        """Replay (capturing on first use, over this batch) the packed pass `key`: `host`'s prompt
        chunks and decodes, padded to `full` (`packed_steps.pad_packed`) within `capacity`."""
        cap = self.captured.get(key)
        if cap is None:
            cap = self.captured[key] = self._capture(program, capacity, 0, None, repr(key), full)
        return self._replay(cap, host, full, None, fed_from)

    def _replay(self, cap: Captured, host: HostInputs, full: HostInputs, inputs: torch.Tensor | None,
                fed_from: Any) -> Any:
        """Refill `cap`'s static buffers from `host` (padded: `full`) and replay it."""
        num_rows = host.num_tokens
        if inputs is None:
            src = fed_rows(host, fed_from, len(full.positions))
            cap.staging.stage([np.asarray(full.token_ids, dtype=np.int64), np.asarray(full.positions, dtype=np.int64),
                               src], [cap.inputs[0], cap.positions[0], cap.fed_from])
            if host.fed:
                fed = cap.fed_from.clamp(min=0)
                cap.inputs[0].copy_(torch.where(cap.fed_from >= 0, fed_from.tokens.index_select(0, fed), cap.inputs[0]))
        else:
            cap.inputs[0, :num_rows].copy_(inputs, non_blocking=True)
            cap.staging.stage([np.asarray(full.positions, dtype=np.int64)], [cap.positions[0]])
        if cap.initial_state is not None:
            cap.initial_state[:, :num_rows].copy_(
                draw_initial_states(self.env.model, host.draws, self.env.dtype, self.env.device, host.positions))
        cap.graph.update(self.env.backend.update_meta(cap.ctx.meta, full.batch))
        cap.graph.replay()
        return cap.outputs

    def prepare(self, key: tuple, program: Program, bucket: int, width: int, num_planes: int,
                state_width: int | None = None, fresh: bool = False, context: bool = True,
                over: HostInputs | None = None) -> Captured:
        """The pass `key` of `bucket` sequences of `width` tokens, captured now unless it was before
        (over padding only, or over `over`: a batch wider than the scratch slots). `run` replays it;
        the runner also calls this at start for the passes it expects (`ModelRunner.capture_at_start`)."""
        cap = self.captured.get(key)
        if cap is None:
            capacity = self.capacity_of(bucket, width, num_planes, context, fresh)
            cap = self.captured[key] = self._capture(program, capacity, width, state_width, repr(key), over)
        return cap

    def _capture(self, program: Program, capacity: MetaCapacity, width: int, state_width: int | None, what: str,
                 over: HostInputs | None = None) -> Captured:
        env, bucket, num_rows = self.env, capacity.max_num_seqs, capacity.max_num_tokens
        if over is None:
            empty = HostInputs([], [], [], _empty_batch(capacity.num_planes, env.block_size), [])
            host = pad(empty, bucket, width, env)       # all padding: capture touches only scratch slots
        else:
            host = over
        meta = env.backend.build_meta(host.batch, capacity)
        positions = torch.as_tensor(np.asarray(host.positions, dtype=np.int64)).to(env.device)[None]
        if state_width is None:
            inputs = torch.zeros(1, num_rows, dtype=torch.long, device=env.device)
        else:
            inputs = torch.zeros(1, num_rows, state_width, dtype=env.dtype, device=env.device)
        initial_state = None
        if env.model.has_initial_state and state_width is None:     # the pass runs the prelude
            initial_state = torch.zeros(1, num_rows, env.model.initial_state_width, dtype=env.dtype,
                                        device=env.device)
        ctx = context(env, host, positions, meta=meta, initial_state=initial_state)
        fed_from = torch.full((num_rows,), -1, dtype=torch.long, device=env.device)
        mirrors = [np.zeros(num_rows, dtype=np.int64)] * (3 if state_width is None else 1)
        staging = StagingRing(mirrors, env.device)

        def step() -> Any:
            ctx.clear_cached()
            return program(inputs, ctx)

        env.backend.update_meta(meta, host.batch)
        graph, outputs = self._record(step)
        # replays draw Huginn's states into the static buffer (`run`): the captured context reads no
        # request, and must not keep a first batch's (`over`) alive for the engine's life
        ctx.draws = [(None, rows) for _, rows in ctx.draws]
        log.info("captured a pass: %s, batch %d", what, bucket)
        return Captured(graph, inputs, positions, initial_state, ctx, outputs, fed_from, staging)

    def _record(self, step: Callable[[], Any]) -> tuple[Any, Any]:
        """(graph, outputs) of `step` captured once (replayed eagerly where capture is off)."""
        with torch.inference_mode():
            graph = self.hal.graph() if self.capture else EagerGraph()
            if not isinstance(graph, EagerGraph):   # an eager graph's capture runs `step` as it is
                step()                     # warm-up: kernel compilation and library handles, outside capture
                self.hal.synchronize()
            return graph, graph.capture(step)


    def run_chain(self, key: tuple, program: Callable[[torch.Tensor, list], Any], hosts: list[HostInputs],
                  widths: list[int], num_planes: list[int], token_ids: np.ndarray, preludes: list[bool]) -> Any:
        """Replay (capturing on first use) the chain of passes `key`: pass j over `hosts[j]` (the same
        sequences, `widths[j]` tokens each, `num_planes[j]` planes), all padded to one bucket, in ONE
        graph. `program(ids, ctxs)` runs every pass: `ids: [1, n0]` the first pass's token ids (the
        real rows `token_ids`), later passes' inputs come from earlier passes on the device.
        `preludes[j]`: pass j runs the prelude (Huginn draws its initial states before the replay).
        One host-to-device copy carries the ids and every pass's positions; each pass's metadata is
        refilled in place (`update_meta`)."""
        env = self.env
        bucket = self.bucket(hosts[0].num_seqs)
        fulls = [pad(h, bucket, w, env) for h, w in zip(hosts, widths)]
        chain = self.chains.get(key)
        if chain is None:
            chain = self.chains[key] = self._capture_chain(program, bucket, widths, num_planes, preludes, repr(key))
        ids = np.zeros(bucket * widths[0], dtype=np.int64)
        ids[:len(token_ids)] = token_ids
        chain.staging.stage([np.concatenate([ids, *(np.asarray(f.positions, dtype=np.int64) for f in fulls)])],
                            [chain.host_ints])
        for state, host in zip(chain.initial_states, hosts):
            if state is not None:
                state[:, :host.num_tokens].copy_(draw_initial_states(env.model, host.draws, env.dtype, env.device,
                                                                     host.positions))
        params = []
        for ctx, full in zip(chain.ctxs, fulls):
            params.extend(env.backend.update_meta(ctx.meta, full.batch))
        chain.graph.update(params)
        chain.graph.replay()
        return chain.outputs

    def _capture_chain(self, program, bucket: int, widths: list[int], num_planes: list[int], preludes: list[bool],
                       what: str) -> Chain:
        env = self.env
        sizes = [bucket * w for w in widths]
        host_ints = torch.zeros(sizes[0] + sum(sizes), dtype=torch.long, device=env.device)
        ids = host_ints[:sizes[0]][None]
        ctxs, initial_states, offset, mirror = [], [], sizes[0], [np.zeros(sizes[0], dtype=np.int64)]
        for size, width, planes, prelude in zip(sizes, widths, num_planes, preludes):
            empty = HostInputs([], [], [], _empty_batch(planes, env.block_size), [])
            host = pad(empty, bucket, width, env)
            meta = env.backend.build_meta(host.batch, self.capacity_of(bucket, width, planes))
            env.backend.update_meta(meta, host.batch)
            positions = host_ints[offset:offset + size][None]
            positions.copy_(torch.as_tensor(np.asarray(host.positions, dtype=np.int64))[None])
            mirror.append(np.asarray(host.positions, dtype=np.int64))
            offset += size
            state = None
            if env.model.has_initial_state and prelude:
                state = torch.zeros(1, size, env.model.initial_state_width, dtype=env.dtype, device=env.device)
            initial_states.append(state)
            ctxs.append(context(env, host, positions, meta=meta, initial_state=state))
        staging = StagingRing([np.concatenate(mirror)], env.device)

        def step() -> Any:
            for ctx in ctxs:
                ctx.clear_cached()
            return program(ids, ctxs)

        graph, outputs = self._record(step)
        log.info("captured a chain of %d passes: %s, batch %d", len(widths), what, bucket)
        return Chain(graph, host_ints, initial_states, ctxs, outputs, staging)


def fed_rows(host: HostInputs, source: Any, num_rows: int) -> np.ndarray:
    """`[num_rows]` int64: for each row whose token the device supplies (`host.fed`), its row in the
    step `source` sampled; -1 elsewhere. Rows of the persistent batch map by array; others by id."""
    src = np.full(num_rows, -1, dtype=np.int64)
    if not host.fed:
        return src
    if source is None:
        raise RuntimeError("a placeholder input token without the step that samples it (an async scheduling bug)")
    rows = [row for row, _ in host.fed]
    if host.rows is not None and source.rows is not None:
        where = np.full(max(int(host.rows.max()), int(source.rows.max())) + 1, -1, dtype=np.int64)
        where[source.rows] = np.arange(len(source.rows))
        src[rows] = where[host.rows[rows]]
    else:
        src[rows] = [source.row_of[rid] for _, rid in host.fed]
    if (src[rows] < 0).any():
        raise RuntimeError("a placeholder input token whose request the previous step did not sample "
                           "(an async scheduling bug)")
    return src


def _empty_batch(num_planes: int, block_size: int):
    from hal.attention import PagedBatch

    return PagedBatch([], [], [[] for _ in range(num_planes)], block_size)
