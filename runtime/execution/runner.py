"""The model runner: owns the model, the attention backend and the paged KV tensors; turns a
scheduled step into batch tensors, runs prelude / loops / coda, and samples.

KV storage is `layers_per_plane` tensors (one per layer slot of a plane), each holding every block
of the pool in the backend's layout; a block id means the same block in every one of them.
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

import torch

from hal.base import Hal, PagedBatch
from runtime.execution.async_step import PendingStep, Readback, StepResult, feed_tokens
from runtime.config import EngineConfig
from runtime.execution.context import PagedContext
from runtime.engine.kv_cache import BlockManager, num_request_planes
from runtime.execution.loops import SeqPlan, run_loops
from runtime.parallel.state import agree_min, capture_allowed
from runtime.execution.quantization import prepare_weights, resolve_kv_dtype
from runtime.execution.logprobs import StepLogprobs, prompt_logits, prompt_rows
from runtime.execution.sampler import SamplingTensors, sample
from runtime.engine.scheduler import ScheduledRequest
from runtime.engine.sequence import PLACEHOLDER
from zoo.base import LoopedCausalLM
from zoo.parallel import rank_heads

log = logging.getLogger(__name__)


def plan_num_blocks(hal: Hal, config: EngineConfig, bytes_per_block: int, max_blocks_useful: int) -> int:
    """KV pool size: explicit, or what the memory budget allows, capped by what could ever be used."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    else:
        free, total = hal.mem_info()
        budget = int(free - total * (1.0 - config.gpu_memory_utilization))
    num_blocks = min(budget // bytes_per_block, max_blocks_useful)
    if num_blocks < 1:
        raise MemoryError(f"no memory left for the KV cache (budget {budget / 2**20:.0f} MiB, "
                          f"{bytes_per_block} bytes per block); raise gpu_memory_utilization or set num_kv_blocks")
    return int(num_blocks)


class ModelRunner:
    def __init__(self, model: LoopedCausalLM, hal: Hal, config: EngineConfig, max_model_len: int,
                 max_loops: int) -> None:
        self.model, self.hal, self.config = model, hal, config
        if config.fuse_projections:
            from zoo.fuse import fuse_projections

            fuse_projections(model)
        prepare_weights(model, hal, config.weights_dtype)          # FP8 linears (after fusing)
        self.device = hal.device()
        param = next(model.parameters())
        self.dtype = param.dtype
        spec = model.kv_spec
        self.kv_spec = spec
        num_heads, num_kv_heads = rank_heads(model)          # this rank's heads under tensor parallelism
        kv_dtype = resolve_kv_dtype(config.kv_dtype, hal)
        quantized = {} if kv_dtype is None else {"kv_dtype": kv_dtype}     # Hals without 8-bit KV keep working
        self.backend = hal.attention(num_heads, num_kv_heads, spec.head_dim, self.dtype,
                                     block_size=config.block_size, **quantized)
        self.block_size = self.backend.block_size
        log.info("attention backend %s (%s)", self.backend.name, self.backend.caps.reason)
        # bytes follow the cache's own dtype: an 8-bit KV cache holds twice the blocks of a bf16 one
        per_layer = math.prod(self.backend.kv_cache_shape(1)) * self.backend.kv_cache_dtype.itemsize
        self.bytes_per_block = per_layer * spec.layers_per_plane
        max_planes = num_request_planes(config.kv_mode, spec.num_fixed_planes, max_loops)
        useful = config.max_num_seqs * math.ceil(max_model_len / self.block_size) * max_planes
        num_blocks = plan_num_blocks(hal, config, self.bytes_per_block, useful)
        self.num_blocks = agree_min(model, num_blocks, self.device)   # tensor parallel: block ids are shared
        # scratch blocks past the pool, which graph padding rows write and read, so padded rows need
        # no special slot values in any backend's kernels; one slot per row of the largest batch, as
        # some KV writes (Ascend's npu_scatter_pa_kv_cache) require the slots of one call to be unique
        self.scratch_block = self.num_blocks
        cache_blocks = self.num_blocks + math.ceil(config.max_num_seqs / self.block_size)
        cache_dtype = self.backend.kv_cache_dtype
        self.kv_caches = [torch.zeros(self.backend.kv_cache_shape(cache_blocks), dtype=cache_dtype,
                                      device=self.device) for _ in range(spec.layers_per_plane)]
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB, kv_mode=%s, kv_dtype=%s", self.num_blocks,
                 self.block_size, self.num_blocks * self.bytes_per_block / 2**20, config.kv_mode,
                 kv_dtype or self.dtype)
        self.graphs = None
        if config.graphs and not self.backend.caps.graphs:
            raise ValueError(f"graphs=true, but attention backend {self.backend.name!r} cannot be captured")
        if self.backend.caps.graphs:
            from runtime.execution.graphs import DecodeGraphs

            # on by default where the Hal records device work; off = the same padded path, eager
            capture = capture_allowed(hal, model, config.graphs)
            self.graphs = DecodeGraphs(self, config.max_num_seqs, max_model_len, capture=capture,
                                       num_copies=2 if config.async_scheduling else 1)
        self.readback = Readback(hal, config.max_num_seqs)       # async scheduling: sampled tokens to host
        self.wave_states: dict[tuple[str, int], torch.Tensor] = {}  # wavefront chunks' states between steps

    def forget(self, request_id: str) -> None:
        """Drop what the runner keeps for a request (wavefront states) once it finished or lost its KV."""
        for key in [k for k in self.wave_states if k[0] == request_id]:
            del self.wave_states[key]

    # ----- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledRequest], blocks: BlockManager,
                input_ids_from_device: PendingStep | None = None,
                deferred: bool = False) -> StepResult | PendingStep:
        """Run one step. Async scheduling: input tokens still unknown to the host (`PLACEHOLDER`)
        are taken on the device from `input_ids_from_device` (the previous step), and `deferred=True`
        leaves the sampled tokens on the device (a `PendingStep` the host reads one step later)."""
        self.fed = input_ids_from_device        # sampling: penalties read tokens still on the device
        if any(item.is_wave for item in scheduled):
            from runtime.execution.wavefront import execute_wave

            return execute_wave(self, scheduled, blocks, input_ids_from_device, deferred)
        if self.graphs is not None and self.graphs.eligible(scheduled):
            requests = [item.request for item in scheduled]
            ids = [r.all_token_ids[r.num_computed_tokens] for r in requests]
            fed = [(i, r.request_id) for i, r in enumerate(requests) if ids[i] == PLACEHOLDER]
            device_ids = feed_tokens(ids, fed, input_ids_from_device, self.device) if fed else None
            logits = self.graphs.run(scheduled, blocks, input_ids=device_ids)
            loops = [r.num_loops for r in requests]
            return self.finish_step(logits, requests, loops, len(scheduled), deferred)
        token_ids, positions, plans = [], [], []
        query_lens, seq_lens, tables = [], [], []
        fed = []
        row = 0
        for item in scheduled:
            req, n = item.request, item.num_tokens
            start = req.num_computed_tokens
            token_ids.extend(req.all_token_ids[start:start + n])
            if token_ids[-1] == PLACEHOLDER:             # async: only a request's newest token can be
                fed.append((row + n - 1, req.request_id))
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            tables.append(blocks.block_tables(req.request_id))
            decoding = n == 1 and start >= len(req.prompt_token_ids)
            plans.append(SeqPlan(req.num_loops, req.exit_threshold, req.params.min_loops,
                                 row + n - 1 if item.samples else None,
                                 decoding and self.config.kv_mode != "full"))
            row += n
        num_planes = max(len(t) for t in tables)
        by_plane = [[t[p] if p < len(t) else [] for t in tables] for p in range(num_planes)]
        batch = PagedBatch(query_lens, seq_lens, by_plane, self.block_size)
        ids = feed_tokens(token_ids, fed, input_ids_from_device, self.device)[None]
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)[None]
        ctx = PagedContext(self.backend, self.kv_caches, batch, pos, self.config.kv_mode,
                           self.kv_spec.num_fixed_planes, self._initial_state_fn(scheduled))

        state = self.model.prelude(ids, ctx)
        result = run_loops(self.model, state, ctx, plans)
        sample_seqs = [i for i, p in enumerate(plans) if p.sample_row is not None]
        logits = None
        if sample_seqs:
            rows = torch.tensor([plans[i].sample_row for i in sample_seqs], dtype=torch.long, device=self.device)
            final = result.state
            if result.sample_state is not None:
                final = final.index_copy(1, rows, result.sample_state)
            logits = self.model.coda(final, ctx, rows=rows)[0].float()           # [R, V]
        elif self.kv_spec.num_fixed_planes:
            self.model.coda(result.state, ctx, rows=torch.zeros(0, dtype=torch.long, device=self.device))
        if result.exits and self.config.kv_mode == "last_exited":
            self._fill_skipped_planes(result.exits, scheduled, plans, blocks)
        # prompt logprobs (runtime/execution/logprobs.py): the coda on the chunk rows that predict prompt tokens
        wanted = prompt_rows(scheduled)
        prompt = (wanted, prompt_logits(self.model, result.state, ctx, wanted)) if wanted else None
        return self.finish_step(logits, [scheduled[i].request for i in sample_seqs], result.sample_loops, row,
                                deferred, prompt)

    def finish_step(self, logits: torch.Tensor | None, requests: Sequence, loops: Sequence[int],
                    num_rows: int, deferred: bool, prompt=None) -> StepResult | PendingStep:
        """Sample `logits: [R, V]` (one row per request of `requests`): to host ints now, or `deferred`
        on the device with an asynchronous copy to host (read by `PendingStep.result()`). Log-
        probabilities, where requests asked (`prompt`: prompt rows and their logits), come along."""
        tokens = self._sample(logits, requests) if requests else None
        logprobs = StepLogprobs.compute(logits, tokens, requests, prompt)
        if deferred:
            return PendingStep(self.readback, tokens, [r.request_id for r in requests], list(loops), num_rows,
                               logprobs)
        sampled, prompt_lp = logprobs.to_host() if logprobs is not None else (None, None)
        values = tokens.tolist() if tokens is not None else []          # the step's one host sync
        return StepResult({r.request_id: (t, n) for r, t, n in zip(requests, values, loops)}, num_rows,
                          sampled, prompt_lp)

    def _sample(self, logits: torch.Tensor, requests: Sequence) -> torch.Tensor:
        """Next tokens `[R]` for `logits: [R, V]`, on the device (runtime/execution/sampler.py)."""
        tensors = SamplingTensors.build(requests, self.device, logits.shape[-1], getattr(self, "fed", None))
        return sample(logits, tensors)

    def _initial_state_fn(self, scheduled: Sequence[ScheduledRequest]):
        """Per-request initial loop states for models that draw one (Huginn), or None."""
        init = getattr(self.model, "initial_state", None)
        if init is None:
            return None

        def initial_state(e: torch.Tensor) -> torch.Tensor:
            # e: [1, T, D]; each request's rows use its own scale and generator
            parts, row = [], 0
            for item in scheduled:
                req = item.request
                parts.append(init(e[:, row:row + item.num_tokens], init_scale=getattr(req.params, "init_scale", None),
                                  generator=req.generator))
                row += item.num_tokens
            return torch.cat(parts, dim=1)

        return initial_state

    def _fill_skipped_planes(self, exits: list[tuple[int, int]], scheduled: Sequence[ScheduledRequest],
                             plans: Sequence[SeqPlan], blocks: BlockManager) -> None:
        """last_exited: copy an exited token's KV from its exit plane into every deeper plane."""
        fixed, bs = self.kv_spec.num_fixed_planes, self.block_size
        src, dst = [], []
        for i, loop in exits:
            req = scheduled[i].request
            pos = req.num_computed_tokens                      # the decoding token's position
            tables = blocks.block_tables(req.request_id)
            slot = lambda plane: tables[plane][pos // bs] * bs + pos % bs
            for deeper in range(loop + 1, plans[i].num_loops):
                src.append(slot(fixed + loop))
                dst.append(slot(fixed + deeper))
        src_t = torch.tensor(src, dtype=torch.long, device=self.device)
        dst_t = torch.tensor(dst, dtype=torch.long, device=self.device)
        for cache in self.kv_caches:
            self.backend.copy_kv(cache, src_t, dst_t)
