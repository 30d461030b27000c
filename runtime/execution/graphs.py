"""Forward passes captured as device graphs: one capture and one replay routine for every kind of
pass (plain decode steps, speculation drafts and verifies).

A pass whose sequences all have the same width (tokens per sequence) and run the same stages is
the same sequence of kernels for a given number of sequences. It is captured once per batch-size
bucket over static buffers (inputs, positions, attention metadata with a fixed capacity, Huginn's
initial states) and replayed after refilling them; batches are padded up to the bucket with
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

import torch

from hal.base import Hal, MetaCapacity
from hal.common.graph import EagerGraph
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


class PassGraphs:
    """Captured passes keyed by what makes their kernels differ (kind, bucket, depth, copy)."""

    def __init__(self, env: PassEnv, hal: Hal, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        self.env, self.hal = env, hal
        self.capture = capture          # False: the same padded static-buffer path, run eagerly
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_num_seqs] + [max_num_seqs]
        self.max_model_len = max_model_len
        self.max_blocks = math.ceil(max_model_len / env.block_size)
        self.captured: dict[tuple, Captured] = {}

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs` sequences (None: too many to capture)."""
        if not 0 < num_seqs <= self.buckets[-1]:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, num_seqs)]

    def run(self, key: tuple, program: Program, host: HostInputs, width: int, num_planes: int,
            inputs: torch.Tensor | None = None, state_width: int | None = None) -> Any:
        """Replay (capturing on first use) the pass `key` over `host` (sequences of `width` tokens),
        padded to its bucket. `inputs`: the real rows' ids `[n]` or states `[n, X]` on the device;
        None takes the ids from `host`. `state_width`: X for passes that start from states."""
        bucket = self.bucket(host.num_seqs)
        full = pad(host, bucket, width, self.env)
        cap = self.captured.get(key)
        if cap is None:
            cap = self.captured[key] = self._capture(program, bucket, width, num_planes, state_width, repr(key))
        num_rows = host.num_tokens
        if inputs is None:
            inputs = torch.tensor(host.token_ids, dtype=torch.long)
        cap.inputs[0, :num_rows].copy_(inputs, non_blocking=True)
        cap.positions[0].copy_(torch.tensor(full.positions, dtype=torch.long), non_blocking=True)
        if cap.initial_state is not None:
            cap.initial_state[:, :num_rows].copy_(
                draw_initial_states(self.env.model, host.draws, self.env.dtype, self.env.device))
        cap.graph.update(self.env.backend.update_meta(cap.ctx.meta, full.batch))
        cap.graph.replay()
        return cap.outputs

    def _capture(self, program: Program, bucket: int, width: int, num_planes: int, state_width: int | None,
                 what: str) -> Captured:
        env = self.env
        empty = HostInputs([], [], [], _empty_batch(num_planes, env.block_size), [])
        host = pad(empty, bucket, width, env)           # all padding: capture touches only scratch slots
        num_rows = bucket * width
        capacity = MetaCapacity(bucket, num_rows, self.max_blocks, num_planes, self.max_model_len)
        meta = env.backend.build_meta(host.batch, capacity)
        positions = torch.tensor([host.positions], dtype=torch.long, device=env.device)
        if state_width is None:
            inputs = torch.zeros(1, num_rows, dtype=torch.long, device=env.device)
        else:
            inputs = torch.zeros(1, num_rows, state_width, dtype=env.dtype, device=env.device)
        initial_state = None
        if env.model.has_initial_state and state_width is None:     # the pass runs the prelude
            initial_state = torch.zeros(1, num_rows, env.model.initial_state_width, dtype=env.dtype,
                                        device=env.device)
        ctx = context(env, host, positions, meta=meta, initial_state=initial_state)

        def step() -> Any:
            ctx.clear_cached()
            return program(inputs, ctx)

        env.backend.update_meta(meta, host.batch)
        with torch.inference_mode():
            step()                         # warm-up: kernel compilation and library handles, outside capture
            self.hal.synchronize()
            graph = self.hal.graph() if self.capture else EagerGraph()
            outputs = graph.capture(step)
        log.info("captured a pass: %s, batch %d", what, bucket)
        return Captured(graph, inputs, positions, initial_state, ctx, outputs)


def _empty_batch(num_planes: int, block_size: int):
    from hal.base import PagedBatch

    return PagedBatch([], [], [[] for _ in range(num_planes)], block_size)
