"""The runner's captured steps: which steps replay captured passes (runtime/execution/graphs.py) and
how. A pure decode step replays the decode pass of its batch bucket over the persistent batch's
rows; a step that is one prompt chunk alone (its prompt's last or not: a long prompt over the
engine's default budget of 2,048) replays the prefill of its token-count bucket;
where no packed pass takes it (runtime/execution/packed_steps.py), a step of up to
`MAX_SPLIT_PROMPTS` prompt chunks (any chunk) of up to `MAX_SPLIT_TOKENS` tokens in all, beside such
decodes or alone, replays those passes one after another, so neither an arrival nor a burst of short
prompts costs an eager pass whose host's launches outlast its device time. `capture_at_start`
captures the passes these steps expect when the engine starts. `ModelRunner` inherits this and
samples what it returns.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Sequence

import numpy as np
import torch

from hal.attention import AttentionBackend
from hal.common.staging import StagingRing
from runtime.engine.kv_cache import BlockManager
from runtime.engine.planes import PlaneLayout
from runtime.engine.step_schedule import ScheduledRequest
from runtime.execution.async_step import PendingStep, StepResult
from runtime.execution.graphs import PassGraphs
from runtime.execution.input_batch import InputBatch
from runtime.execution.prefill_buckets import PrefillBuckets
from runtime.execution.programs import ExitRows, decode_program, prefill_program, with_loops
from runtime.execution.step_inputs import PassEnv, describe, describe_rows, extend
from zoo.base import LoopedCausalLM

log = logging.getLogger(__name__)

# A step of up to MAX_SPLIT_PROMPTS prompt chunks of MAX_SPLIT_TOKENS tokens in all replays captured
# prefills beside its captured decode pass (`split_step`). Each replay pays a pass's fixed cost once
# more (about 2 ms at Ouro-1.4B's shape: the weight reads past its compute, its ~1,000 kernels' tails);
# the one eager pass pays its host's launches once (about 50-70 ms on an H100 host, against about 49 ms
# of kernels for 2K tokens: level, so the eager side depends on the machine's host). Measured warm on
# H100s (docs/performance.md, levers 108 and the forty-second session): 64 x 128-token prompts at a 512
# budget (4-5 chunks a step) 701-710 ms TTFT split under a cap of 8, 807-825 under 4, 899-910 eager; a
# 1K chunk a step split 2,705 against 3,348 eager; two 1K chunks a step split 2,098-2,109 against
# 1,741-2,665 eager (1,772-1,806 on three machines, a median of about 2,230 on two others), and sixteen
# 128-token chunks 393 against 302.
MAX_SPLIT_PROMPTS = 8
MAX_SPLIT_TOKENS = 1024
# One chunk beside decodes (a request joining) splits up to this many tokens, the engine's default budget:
# two replays whatever its size. Measured on an H100 at 2,048 (docs/performance.md, lever 110): a
# 1,500-token prompt joining 64 decodes 80.9-81.1 ms to its first token split against 89.4-151.6
# eager; a 4K prompt's chunks beside them 207.4-208.8 split against 217.3-219.9 as one packed pass.
MAX_SPLIT_TOKENS_ONE_CHUNK = 2048


class CapturedSteps:
    """The captured steps of `ModelRunner`, which inherits them and sets what they read below."""

    model: LoopedCausalLM
    layout: PlaneLayout
    env: PassEnv
    backend: AttentionBackend
    block_size: int
    device: torch.device
    graphs: PassGraphs | None
    prefill_buckets: PrefillBuckets
    input_batch: InputBatch
    num_graph_copies: int
    num_decode_replays: int
    prefill_rows: dict[tuple, torch.Tensor]
    exit_rows: dict[tuple, ExitRows]
    captures_exits: bool
    start_capture_s: float

    def capture_at_start(self, num_loops: int, max_model_len: int) -> None:
        """Capture now what steps at depth `num_loops` replay: the decode step of every batch bucket
        (each graph copy) and the prefill of every short token-count bucket a prompt of at most
        `max_model_len` tokens takes, with and without prior context. Otherwise the first step of
        each batch size or prompt length waits for its capture (vLLM captures at start as well).
        Longer prefills are captured over their first prompt (`PassGraphs.run`)."""
        start, graphs = time.perf_counter(), self.graphs
        num_planes = self.layout.num_planes(num_loops)
        for bucket in graphs.buckets:
            for copy in range(self.num_graph_copies):
                graphs.prepare(("decode", bucket, num_loops, copy), decode_program(self.model, num_loops),
                               bucket, 1, num_planes)
        widest, below = self.backend.caps.max_context_prefill_width, 0
        for width in self.prefill_buckets.short_widths(max_model_len):
            # the shortest and the longest prompt it takes: both attentions where the fresh line crosses it
            for num_tokens in (below + 1, width):
                for context in (False, True) if widest is None or width <= widest else (False,):
                    key = self.prefill_key(width, num_loops, int(context), num_tokens)
                    program = prefill_program(self.model, num_loops, self.sample_row(key))
                    graphs.prepare(key, program, 1, width, num_planes, fresh=key[4], context=context)
            below = width
        self.start_capture_s = time.perf_counter() - start
        log.info("captured %d passes at start in %.2f s", len(graphs.captured), self.start_capture_s)

    def prefill_bucket(self, scheduled: Sequence[ScheduledRequest]) -> int | None:
        """The captured prefill width for a step that is one prompt chunk alone, or None. A chunk that
        is not its prompt's last (a long prompt over a budget of 2,048, the engine's default) replays
        the same pass and samples nothing: one replay, so no cap applies. Unlike `split_step`, this
        holds where passes are not captured too: the same padded pass then runs eagerly, so turning
        graphs off changes no kernel's shapes for a lone prompt."""
        if self.graphs is None or len(scheduled) != 1:
            return None
        return self.chunk_bucket(scheduled[0])

    def chunk_bucket(self, item: ScheduledRequest) -> int | None:
        """The captured prefill width that runs one prompt chunk (of a step of several, `split_step`),
        or None. A chunk that is not its prompt's last runs the same pass, whose one row of logits
        nobody samples. Early exit only where every loop runs anyway (`captures_exits`)."""
        req = item.request
        if (self.graphs is None or item.is_wave or item.num_tokens < 2
                or (req.exit_threshold < 1.0 and not self.captures_exits)
                or req.params.prompt_logprobs is not None):
            return None
        width, widest = self.prefill_buckets.bucket(item.num_tokens), self.backend.caps.max_context_prefill_width
        if width is not None and item.first_token > 0 and widest is not None and width > widest:
            return None
        return width

    def is_graph_step(self, scheduled: Sequence[ScheduledRequest]) -> bool:
        """A pure decode step that a captured pass can run (see the module docstring); early exit only
        where every loop runs anyway (`captures_exits`)."""
        if self.graphs is None or self.graphs.bucket(len(scheduled)) is None:
            return False
        loops = scheduled[0].request.num_loops
        return all(item.num_tokens == 1 and item.samples and not item.is_wave and item.request.num_loops == loops
                   and (item.request.exit_threshold >= 1.0 or self.captures_exits)
                   and item.request.num_planes <= self.input_batch.tables.shape[0]
                   for item in scheduled)

    def split_step(self, scheduled: Sequence[ScheduledRequest]) -> tuple[list, list] | None:
        """(decodes, [(prompt chunk, its width)]) of a step of prompt chunks that captured prefills
        run, up to `MAX_SPLIT_PROMPTS` of them and `MAX_SPLIT_TOKENS` tokens (one chunk: up to
        `MAX_SPLIT_TOKENS_ONE_CHUNK`), beside decodes that a captured decode pass runs (or none):
        the step replays those passes instead of one eager pass, whose host work (about a thousand
        launches issued from Python, about 50 ms on the H100's host) would stall every decoding
        request each time a request joins, and pace a burst of short
        prompts prefilled chunk by chunk. Past those limits the eager pass's device time covers its
        host's, and each replay more would add its fixed cost. Where the Hal captures but
        `graphs=false` turned capture off, the same passes run eagerly, so turning capture off to
        debug it changes no kernel's shapes or rounding (a packed pass would, and bf16 near-ties would
        flip between the two). None for any other step, and where
        passes are not captured otherwise (the CPU by default, tensor parallelism on a Hal that cannot
        capture collectives): there one packed pass reads the weights once and pads nothing."""
        turned_off = self.config.graphs is False and self.hal.caps.graphs
        if self.graphs is None or not (self.graphs.capture or turned_off):
            return None
        decodes = [item for item in scheduled if item.num_tokens == 1]
        prompts = [item for item in scheduled if item.num_tokens > 1]
        num_tokens = sum(item.num_tokens for item in prompts)
        limit = MAX_SPLIT_TOKENS_ONE_CHUNK if len(prompts) == 1 else MAX_SPLIT_TOKENS
        if not 0 < len(prompts) <= MAX_SPLIT_PROMPTS or num_tokens > limit:
            return None
        if decodes and not self.is_graph_step(decodes):
            return None
        widths = [self.chunk_bucket(item) for item in prompts]
        if None in widths:
            return None
        return decodes, list(zip(prompts, widths))

    def _execute_split(self, decodes: list[ScheduledRequest], prompts: list[tuple[ScheduledRequest, int]],
                       blocks: BlockManager, fed_from: PendingStep | None,
                       deferred: bool) -> StepResult | PendingStep:
        # each pass's logits (and exit loops) are copied out before the next replay, which may reuse
        # the pool's memory
        logits, loops, requests = [], [], [item.request for item in decodes]
        if decodes:
            out, _, _, chosen = self._decode_logits(decodes, blocks, fed_from)
            logits.append(out.clone())
            loops.append((None if chosen is None else chosen.clone(), decodes[0].request.num_loops, len(decodes)))
        for item, width in prompts:
            row, chosen = self._prefill_logits(item, width, blocks, fed_from)
            if item.samples:
                logits.append(row.clone())
                loops.append((None if chosen is None else chosen.clone(), item.request.num_loops, 1))
                requests.append(item.request)
        num_rows = len(decodes) + sum(item.num_tokens for item, _ in prompts)
        return self.finish_step(torch.cat(logits) if logits else None, requests, self._step_loops(loops),
                                num_rows, deferred, fed_from=fed_from)

    def _step_loops(self, parts: list[tuple[torch.Tensor | None, int, int]]) -> list[int] | torch.Tensor:
        """The loops behind a split step's logits from its passes' `(exit loops on the device or None,
        loops, rows)`: host ints, or one device tensor where a pass chose early exits (the others'
        filled on the device: no host value travels)."""
        if all(chosen is None for chosen, _, _ in parts):
            return [num_loops for _, num_loops, n in parts for _ in range(n)]
        return torch.cat([chosen if chosen is not None else
                          torch.full((n,), num_loops, dtype=torch.long, device=self.device)
                          for chosen, num_loops, n in parts])

    def _execute_captured(self, scheduled: Sequence[ScheduledRequest], blocks: BlockManager,
                          fed_from: PendingStep | None, deferred: bool) -> StepResult | PendingStep:
        logits, rows, positions, exit_loops_of = self._decode_logits(scheduled, blocks, fed_from)
        requests = [item.request for item in scheduled]
        loops = exit_loops_of if exit_loops_of is not None else [r.num_loops for r in requests]
        return self.finish_step(logits, requests, loops, len(scheduled), deferred,
                                fed_from=fed_from, rows=rows, positions=positions)

    def _decode_logits(self, scheduled: Sequence[ScheduledRequest], blocks: BlockManager, fed_from: PendingStep | None
                       ) -> tuple[torch.Tensor, np.ndarray, list[int], torch.Tensor | None]:
        """The captured decode pass over the persistent batch's rows of `scheduled`: (logits `[n, V]`,
        in the graph's output buffer; the rows; the input positions; where a row exits early, the
        loops behind each row's logits `[n]` on the device, else None)."""
        requests = [item.request for item in scheduled]
        loops = requests[0].num_loops
        batch = self.input_batch
        rows = batch.rows(requests, blocks)
        host = describe_rows(batch.tables, batch.lengths, rows, requests, requests[0].num_planes, self.block_size)
        copy = self.num_decode_replays % self.num_graph_copies
        self.num_decode_replays += 1
        bucket = self.graphs.bucket(len(scheduled))
        if all(r.exit_threshold >= 1.0 for r in requests):
            logits = self.graphs.run(("decode", bucket, loops, copy), decode_program(self.model, loops), host, 1,
                                     self.layout.num_planes(loops), fed_from=fed_from)
            return logits[:len(scheduled)], rows, host.positions, None
        key = ("decode_exit", bucket, loops, copy)
        exits = self._exit_rows(key, bucket, requests)
        logits, chosen = self.graphs.run(key, decode_program(self.model, loops, exits), host, 1,
                                         self.layout.num_planes(loops), fed_from=fed_from)
        return logits[:len(scheduled)], rows, host.positions, chosen[:len(scheduled)]

    def _exit_rows(self, key: tuple, bucket: int, requests: Sequence) -> ExitRows:
        """The static exit settings of captured pass `key`, refilled for `requests` (padding rows
        take their last loop), by copies ordered after the replay that may still read them."""
        threshold = np.full(bucket, math.inf, dtype=np.float32)
        threshold[:len(requests)] = [r.exit_threshold if r.exit_threshold < 1.0 else math.inf for r in requests]
        min_loops = np.zeros(bucket, dtype=np.int64)
        min_loops[:len(requests)] = [r.params.min_loops for r in requests]
        exits = self.exit_rows.get(key)
        if exits is None:
            exits = self.exit_rows[key] = ExitRows(torch.full((bucket,), math.inf, device=self.device),
                                                   torch.zeros(bucket, dtype=torch.long, device=self.device),
                                                   StagingRing([threshold, min_loops], self.device))
        exits.staging.stage([threshold, min_loops], [exits.threshold, exits.min_loops])
        return exits

    def _execute_prefill(self, item: ScheduledRequest, width: int, blocks: BlockManager,
                         fed_from: PendingStep | None, deferred: bool) -> StepResult | PendingStep:
        logits, exit_loops_of = self._prefill_logits(item, width, blocks, fed_from)
        requests = [item.request] if item.samples else []
        loops = exit_loops_of if exit_loops_of is not None else [item.request.num_loops] * len(requests)
        return self.finish_step(logits if requests else None, requests, loops, item.num_tokens, deferred,
                                fed_from=fed_from)

    def _prefill_logits(self, item: ScheduledRequest, bucket: int, blocks: BlockManager,
                        fed_from: PendingStep | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The captured prefill of one prompt chunk at width `bucket`: (logits `[1, V]` of its last
        token, in the graph's output buffer; where its request exits early and the chunk samples, the
        loop behind them `[1]` on the device, else None)."""
        req = item.request
        host = extend(describe([self.slice_of(item, blocks)], req.num_planes, self.block_size), bucket, self.env)
        key = self.prefill_key(bucket, req.num_loops, item.first_token, item.num_tokens)
        exits = None
        if req.exit_threshold < 1.0 and item.samples:
            key = ("prefill_exit", *key[1:])
            exits = self._exit_rows(key, 1, [req])
        sample_row = self.sample_row(key)
        sample_row.copy_(torch.tensor([item.num_tokens - 1]), non_blocking=True)
        out = self.graphs.run(key, prefill_program(self.model, req.num_loops, sample_row, exits), host, bucket,
                              key[3], fed_from=fed_from, fresh=key[4], context=key[5])
        return with_loops(out, exits)

    def prefill_key(self, width: int, num_loops: int, first_token: int, num_tokens: int) -> tuple:
        """The captured prefill of `width` tokens at depth `num_loops` for a chunk of `num_tokens` from
        `first_token`: ("prefill", width, loops, planes, fresh attention, prior context). The chunk's own
        length decides the attention, as in its eager pass, so one width may have both kinds."""
        fresh = self.prefill_buckets.attends_fresh(num_tokens, first_token)
        return "prefill", width, num_loops, self.layout.num_planes(num_loops), fresh, first_token > 0

    def sample_row(self, key: tuple) -> torch.Tensor:
        """`[1]` int64: the static buffer naming the row whose logits the captured prefill `key` samples."""
        if key not in self.prefill_rows:
            self.prefill_rows[key] = torch.zeros(1, dtype=torch.long, device=self.device)
        return self.prefill_rows[key]
