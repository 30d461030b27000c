"""The runner's packed captured steps: a step of prompt chunks, with or without decodes beside them
(requests joining a decoding batch, a burst of prompts chunked over a server's token budget),
replays one captured pass over all of its rows, packed as the eager pass packs them, where the
attention backend captures packed batches (`AttnCaps.packed_graphs`: the Triton backend of the CUDA
and ROCm Hals, the CPU reference); elsewhere `split_step` replays a decode pass and a prefill per
chunk, up to its caps.

Why (docs/performance.md, lever 109, measured on H100s): the eager pass of such a step waits on its
host (47-63 ms of host against about 49 ms of kernels for 2,048 tokens: tools/eager_host_cost.py),
and a split step reads the weights once per pass it replays, where a packed one reads them once.
The 64 x 1K burst at a budget of 2,048 took 1,750-1,756 ms packed against 1,934-2,332 eager; at
1,024, 2,422-2,434 against 3,013-3,015 split; 64 x 128 tokens at 512, 420-463 against 718-721 split.

A packed pass is captured per token count (rounded up to `PACKED_GRANULE` where the scratch slots
hold the padding) at a fixed capacity of `max_num_seqs + 1` sequences: the paged kernel's grid
follows the token and sequence counts alone, so one graph takes any mix of chunk lengths. Padding is
one sequence holding the rows up to the token count, in scratch slots past the pool, then sequences
without tokens. Where the step's tokens are a multiple of the granule (every full step of a burst at
a budget of 512 or more), nothing is padded and the kernels' shapes are the eager pass's. A token
count's first step runs the padded pass uncaptured, its second captures it: a count that never
recurs (a burst's last step) does not pay a capture. With capture turned off (`graphs=false` on a Hal
that captures) the same padded pass runs eagerly. Decode rows attend through the paged kernel's
prefill config, as in the eager pass, not the row kernel of decode steps.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch

from hal.attention import AttentionBackend, MetaCapacity, PagedBatch
from hal.base import Hal
from runtime.config import EngineConfig
from runtime.engine.kv_cache import BlockManager
from runtime.engine.planes import PlaneLayout
from runtime.engine.step_schedule import ScheduledRequest
from runtime.execution.async_step import PendingStep, StepResult
from runtime.execution.programs import prefill_program, with_loops
from runtime.execution.graphs import PassGraphs
from runtime.execution.step_inputs import HostInputs, PassEnv, describe, place
from zoo.base import LoopedCausalLM

PACKED_GRANULE = 128       # token counts are captured in steps of this many, where the scratch slots hold the padding
# Steps of more tokens run eagerly: there the eager pass's kernels outlast its host (an H100's 8,192-token
# steps: about 170 ms of kernels against about 55 ms of host), so a capture would only add its own cost
# (the 64 x 1K burst at a budget of 8,192: 1,684-1,797 ms packed, 1,416-1,428 eager; lever 109).
PACKED_MAX_TOKENS = 2048


class PackedShape(NamedTuple):
    num_seqs: int          # sequence capacity: the real ones, then padding
    num_tokens: int        # the step's tokens rounded up to the granule


def pad_packed(host: HostInputs, shape: PackedShape, env: PassEnv) -> HostInputs:
    """`host` (packed sequences) padded to `shape`: one sequence of the missing rows at position 0 of
    the scratch blocks (it touches nobody's KV), then sequences without tokens; tables as one array."""
    from hal.common.paged import block_table_array, table_lengths

    batch, bs = host.batch, env.block_size
    num_real, num_planes = host.num_seqs, len(batch.block_tables)
    extra = shape.num_tokens - host.num_tokens
    assert num_real < shape.num_seqs and 0 <= extra <= env.num_scratch_slots, "a packed step past its capacity"
    num_pad, span = shape.num_seqs - num_real, -(-extra // bs)
    real = block_table_array(batch)                                                          # [P, n, B]
    tables = np.zeros((num_planes, shape.num_seqs, max(real.shape[2], span, 1)), dtype=np.int32)
    tables[:, :num_real, :real.shape[2]] = real
    tables[:, num_real, :span] = env.scratch_block + np.arange(span)
    lengths = np.zeros((num_planes, shape.num_seqs), dtype=np.int64)
    lengths[:, :num_real] = table_lengths(batch)
    lengths[:, num_real] = span
    padding = np.zeros(num_pad, dtype=np.int64)
    padding[0] = extra
    query_lens = np.concatenate([np.asarray(batch.query_lens, dtype=np.int64), padding])
    seq_lens = np.concatenate([np.asarray(batch.seq_lens, dtype=np.int64), padding])
    positions = np.concatenate([np.asarray(host.positions, dtype=np.int64), np.arange(extra, dtype=np.int64)])
    token_ids = np.concatenate([np.asarray(host.token_ids, dtype=np.int64), np.zeros(extra, dtype=np.int64)])
    return HostInputs(token_ids, host.fed, positions, PagedBatch(query_lens, seq_lens, tables, bs, lengths),
                      host.draws + [(None, int(n)) for n in padding], host.rows)


class PackedSteps:
    """The packed captured steps of `ModelRunner`, which inherits them and sets what they read."""

    model: LoopedCausalLM
    config: EngineConfig
    hal: Hal
    env: PassEnv
    backend: AttentionBackend
    graphs: PassGraphs | None
    layout: PlaneLayout
    device: torch.device
    block_size: int
    packed_rows: dict[tuple, torch.Tensor]
    packed_seen: set[tuple]
    captures_exits: bool

    def packed_step(self, scheduled: Sequence[ScheduledRequest]) -> PackedShape | None:
        """The shape of the packed pass that runs this step, or None (a split or the eager pass runs
        it): a step of two or more prompt chunks (a burst, whose full steps recur at one token count)
        and of at most `PACKED_MAX_TOKENS` tokens, every row at one depth without wavefront segments
        or prompt logprobs (nor early exit, unless every loop runs anyway: `captures_exits`), on a
        backend whose captured passes take packed batches.
        A lone chunk beside decodes (a request joining) keeps `split_step`, whose passes the engine
        captured at start: its token count seldom recurs, and a capture inside it (about two passes
        of host work) cost a 128-token join 254-272 ms of TTFT against 54 ms split; where its count
        does recur (a long prompt's chunks that fill the budget), split still beat the packed pass
        (a 4K prompt joining 64 decodes at 2,048: 207-209 ms to its first token against 217-220)."""
        turned_off = self.config.graphs is False and self.hal.caps.graphs
        if (self.graphs is None or not (self.graphs.capture or turned_off)
                or not self.backend.caps.packed_graphs or len(scheduled) >= self.graphs.buckets[-1] + 1):
            return None
        loops = scheduled[0].request.num_loops
        num_tokens = sum(item.num_tokens for item in scheduled)
        if sum(item.num_tokens > 1 for item in scheduled) < 2 or num_tokens > PACKED_MAX_TOKENS or not all(
                not item.is_wave and item.request.num_loops == loops
                and (item.request.exit_threshold >= 1.0 or self.captures_exits)
                and item.request.params.prompt_logprobs is None for item in scheduled):
            return None
        rounded = -(-num_tokens // PACKED_GRANULE) * PACKED_GRANULE
        if rounded - num_tokens > self.env.num_scratch_slots:     # (a runner without medium prefill buckets)
            rounded = num_tokens
        return PackedShape(self.graphs.buckets[-1] + 1, rounded)

    def _execute_packed(self, scheduled: Sequence[ScheduledRequest], shape: PackedShape, blocks: BlockManager,
                        fed_from: PendingStep | None, deferred: bool) -> StepResult | PendingStep:
        loops = scheduled[0].request.num_loops
        num_planes = self.layout.num_planes(loops)
        host = describe([self.slice_of(item, blocks) for item in scheduled], num_planes, self.block_size)
        full = pad_packed(host, shape, self.env)
        key = ("packed", shape.num_tokens, shape.num_seqs, loops, num_planes)
        exits = None
        if any(item.request.exit_threshold < 1.0 for item in scheduled):
            key = ("packed_exit", *key[1:])
            exits = self._exit_rows(key, shape.num_seqs, [item.request for item in scheduled])   # CapturedSteps
        ends = np.cumsum(np.asarray(full.batch.query_lens, dtype=np.int64)) - 1
        rows = self.packed_rows.get(key)
        if rows is None:
            rows = self.packed_rows[key] = torch.zeros(shape.num_seqs, dtype=torch.long, device=self.device)
        rows.copy_(torch.from_numpy(np.maximum(ends, 0)), non_blocking=True)
        capacity = MetaCapacity(shape.num_seqs, shape.num_tokens, self.graphs.max_blocks_of(PACKED_GRANULE),
                                num_planes, self.graphs.max_model_len + PACKED_GRANULE, packed=True)
        program = prefill_program(self.model, loops, rows, exits)
        if key in self.graphs.captured or key in self.packed_seen:
            out = self.graphs.run_packed(key, program, host, full, capacity, fed_from)
        else:
            # a token count's first step runs the same padded pass uncaptured: a capture costs about
            # two eager passes of host work, which a count that never recurs (a burst's last step)
            # would not repay
            self.packed_seen.add(key)
            inputs = place(self.env, full, fed_from, capacity=capacity)
            out = program(inputs.ids, inputs.ctx)
        logits, chosen = with_loops(out, exits)                # chosen: each row's exit loops
        sampling = [i for i, item in enumerate(scheduled) if item.samples]
        requests = [scheduled[i].request for i in sampling]
        if len(sampling) == len(scheduled):
            picked = slice(0, len(scheduled))
        elif sampling:
            picked = torch.as_tensor(sampling).to(self.device, non_blocking=True)
        else:
            return self.finish_step(None, [], [], host.num_tokens, deferred, fed_from=fed_from)
        logits = logits[picked]
        step_loops = [loops] * len(requests) if chosen is None else chosen[picked]
        return self.finish_step(logits, requests, step_loops, host.num_tokens, deferred, fed_from=fed_from)
