"""A sync round of greedy requests as one captured graph: the K + 1 draft passes and the verify
pass of runtime/speculation/speculator.py's round replayed as one chain (`drafting.round_program`,
`PassGraphs.run_chain`) with one host sync for its tokens.

The same passes, shapes and kernels as the per-pass round, so the drafts, verdicts and committed
tokens are the per-pass round's. `Speculator` inherits `FusedRound`: the round is one way of running
the speculator's work, so it reads the speculator's runner, config, model, mode and counters, and
caches there whether the backend advances decode metadata on the device (`advances`).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from runtime.engine.kv_cache import BlockManager
from runtime.engine.sequence import Request
from runtime.execution.step_inputs import describe_rows, pad, planes_of, shifted, widened
from runtime.speculation.acceptance import RoundVerdict, accept_greedy
from runtime.speculation.drafting import round_program
from zoo.parallel import tensor_parallel


class RoundPlan(NamedTuple):
    """What committing a round needs of its draft (a `DraftBatch` has these too)."""

    requests: list
    starts: list[int]
    num_drafts: list[int]


class FusedRound:
    """The fused round of `Speculator` (its base class): whether a round qualifies, blocks for K
    positions per request, and the round itself."""

    def _fusable(self, requests: Sequence[Request], num_drafts: Sequence[int]) -> bool:
        """A sync round that one captured chain can run: every request greedy and at the same depth,
        within a captured bucket and the persistent batch, K <= block_size (padding rows' scratch
        blocks). Async mode keeps its per-pass draft, which it extends; Huginn draws initial states
        per pass. Requests scheduled fewer than K drafts also need `_room_for_k`."""
        runner = self.runner
        graphs, loops = runner.graphs, requests[0].num_loops
        return (self.config.fuse_round and not self.is_async and graphs is not None
                and graphs.bucket(len(requests)) is not None and not self.model.has_initial_state
                and self.config.num_tokens <= runner.block_size
                and all(r.num_loops == loops and r.params.is_greedy
                        and r.num_planes <= runner.input_batch.tables.shape[0] for r in requests))

    def _room_for_k(self, requests: Sequence[Request], num_drafts: Sequence[int], blocks: BlockManager) -> bool:
        """A round of K positions for every request, also those scheduled fewer drafts (near max_tokens,
        short of budget or blocks): blocks for the extra positions, if the pool and the tables have
        them. Their KV lies beyond the computed tokens (stale, trimmed after the round)."""
        runner = self.runner
        num_tokens, max_tokens = self.config.num_tokens, runner.input_batch.max_blocks * runner.block_size
        tp = tensor_parallel(self.model)
        for r, k in zip(requests, num_drafts):
            needed = r.num_computed_tokens + num_tokens + 1
            if k == num_tokens or all(len(t) * runner.block_size >= needed
                                      for t in blocks.block_tables(r.request_id)[:r.num_planes]):
                continue
            # tensor parallelism: the other ranks got this step's tables in its plan, so allocate nothing
            if (tp is not None and tp.world_size > 1) or needed > max_tokens \
                    or not blocks.can_allocate(r.request_id, r.num_planes, needed):
                return False
            blocks.allocate(r.request_id, r.num_planes, needed)
        return True

    def _fused_round(self, requests: Sequence[Request], blocks: BlockManager,
                     num_drafts: Sequence[int] | None = None) -> tuple[RoundPlan, RoundVerdict]:
        """The K+1 draft passes and the verify pass of a greedy round as ONE graph replay
        (`drafting.round_program`) and one host sync for its tokens: the same passes, shapes and
        kernels as the per-pass round (`_draft` then `verify`), so the same tokens. A request
        scheduled k < K drafts runs K and keeps its first k (later positions cannot change earlier
        ones: causal attention, row-wise stages). The host builds two passes' inputs from the
        persistent batch (draft pass 0 and the verify); draft passes 1..K advance pass 0's on the
        device where the backend can (`advance_meta`), else the host fills each."""
        runner, env, k, d = self.runner, self.runner.env, self.config.num_tokens, self.config.draft_loops
        graphs, loops, num_seqs, batch = runner.graphs, requests[0].num_loops, len(requests), runner.input_batch
        bucket = graphs.bucket(num_seqs)
        batch.sync(blocks)
        rows = batch.rows(requests, blocks)
        num_planes, draft_planes = requests[0].num_planes, env.layout.num_fixed_planes + d
        full = describe_rows(batch.tables, batch.lengths, rows, requests, num_planes, env.block_size)
        first = planes_of(full, draft_planes)
        if self.advances is None:           # does the backend advance metadata on the device?
            probe = env.backend.build_meta(pad(first, bucket, 1, env).batch)
            self.advances = env.backend.advance_meta(probe, 1) is not None
        hosts = [first] if self.advances else [first] + [shifted(first, j) for j in range(1, k + 1)]
        hosts.append(widened(full, k + 1))
        widths = [1] * (len(hosts) - 1) + [k + 1]
        key = ("round", bucket, d, loops, k, num_planes, self.advances)
        program = round_program(self.model, d, loops, k, bucket, self.advances)
        out = graphs.run_chain(key, program, hosts, widths, [draft_planes] * (len(hosts) - 1) + [num_planes],
                               np.asarray(full.token_ids, dtype=np.int64), [True] * (len(hosts) - 1) + [False])
        host = out[:num_seqs].tolist()                     # the round's one host sync
        ks = list(num_drafts) if num_drafts is not None else [k] * num_seqs
        drafts = [row[:n] for row, n in zip(host, ks)]
        num_accepted = [accept_greedy(x, row[k:k + n + 1]) for x, row, n in zip(drafts, host, ks)]
        finals = [row[k + n] for row, n in zip(host, num_accepted)]
        c = self.counters
        c.num_draft_loop_passes += (k + 1) * d
        c.num_draft_token_loops += num_seqs * (k + 1) * d
        c.num_verify_loop_passes += loops - d
        c.num_verify_token_loops += num_seqs * (k + 1) * (loops - d)
        return (RoundPlan(list(requests), full.positions.tolist(), ks),
                RoundVerdict(drafts, num_accepted, finals, [-1] * num_seqs))
