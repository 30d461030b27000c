"""The model runner: owns the model, the attention backend and the paged KV tensors; turns a
scheduled step into forward passes and samples.

KV storage is `layers_per_plane` tensors (one per layer slot of a plane), each holding every block
of the pool in the backend's layout; a block id means the same block in every one of them.

`execute` runs every kind of step through one path: a step that captured passes can run replays
them, so it costs its device work rather than a thousand launches from the host: pure decode steps
over the persistent batch (runtime/execution/input_batch.py) and a prompt chunk alone, its
prompt's last or not (runtime/execution/captured_steps.py, which the runner inherits); a step of two
or more prompt chunks (up to 2,048 tokens), with or without decodes, at one depth: one packed pass
where the attention backend captures packed batches (runtime/execution/packed_steps.py, inherited
too); other steps of chunks (a lone chunk beside decodes, of up to 2,048 tokens): a decode pass and a
prefill per chunk, up to caps (`split_step`). Any other step
runs eagerly, packed: prompts, prompt chunks and decodes together, and wavefront segments (the eager
pass, runtime/execution/eager_pass.py, which the runner inherits too). Every path ends in
`finish_step`, which samples the logits.
"""
from __future__ import annotations

import logging
import math
from typing import Sequence

import torch

from hal.base import Hal
from runtime.config import EngineConfig
from runtime.engine.kv_cache import BlockManager
from runtime.engine.planes import PlaneLayout
from runtime.engine.step_schedule import ScheduledRequest
from runtime.execution.async_step import PendingStep, Readback, StepResult, pack_step_values, unpack_step_values
from runtime.execution.captured_steps import CapturedSteps
from runtime.execution.programs import ExitRows
from runtime.execution.eager_pass import EagerPass
from runtime.execution.graphs import PassGraphs
from runtime.execution.input_batch import InputBatch
from runtime.execution.kv_pool import check_cache_fits, plan_num_blocks
from runtime.execution.quantization import prepare_weights, resolve_kv_dtype
from runtime.execution.logprobs import StepLogprobs
from runtime.execution.packed_steps import PackedSteps
from runtime.execution.prefill_buckets import PrefillBuckets
from runtime.execution.row_sampling import RowSampling, StepRows
from runtime.execution.sampler import SamplingTensors, sample
from runtime.execution.step_inputs import PassEnv
from runtime.parallel.state import agree_min, capture_allowed
from zoo.base import LoopedCausalLM
from zoo.context import ModelOps
from zoo.parallel import rank_heads

log = logging.getLogger(__name__)

class ModelRunner(EagerPass, CapturedSteps, PackedSteps):
    def __init__(self, model: LoopedCausalLM, hal: Hal, config: EngineConfig, max_model_len: int,
                 max_loops: int) -> None:
        self.model, self.hal, self.config = model, hal, config
        self.ops = ModelOps(hal)                       # the only Hal the model computes with
        if config.fuse_projections:
            from zoo.fuse import fuse_projections

            fuse_projections(model)
        prepare_weights(model, self.ops, config.weights_dtype)          # FP8 linears (after fusing)
        self.device = hal.device()
        self.dtype = next(model.parameters()).dtype
        spec = model.kv_spec
        self.kv_spec = spec
        self.layout = PlaneLayout(config.kv_mode, spec.num_fixed_planes)
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
        useful = config.max_num_seqs * math.ceil(max_model_len / self.block_size) * self.layout.num_planes(max_loops)
        num_blocks = plan_num_blocks(hal, config, self.bytes_per_block, useful)
        self.num_blocks = agree_min(model, num_blocks, self.device)   # tensor parallel: block ids are shared
        # scratch slots past the pool, which the padding rows of captured passes write and read, so
        # padded rows need no special slot values in any backend's kernels (step_inputs.pad): enough
        # for the largest captured pass (a verify pass: the drafts and the token before them, per
        # sequence; a prefill capture: one sequence of a short bucket, the padding of a longer one)
        if config.graphs and not self.backend.caps.graphs:
            raise ValueError(f"graphs=true, but attention backend {self.backend.name!r} cannot be captured")
        # on by default where the Hal records device work; off = the same padded path, eager
        captures = self.backend.caps.graphs and capture_allowed(hal, model, config.graphs)
        self.prefill_buckets = PrefillBuckets(config.max_num_batched_tokens, captures,
                                              self.backend.caps.fresh_min_tokens)
        num_scratch_slots = max(config.max_num_seqs * (config.speculative.num_tokens + 1),
                                self.prefill_buckets.scratch_tokens(self.block_size))
        cache_blocks = self.num_blocks + math.ceil(num_scratch_slots / self.block_size)
        memory = hal.mem_info()
        check_cache_fits(config, cache_blocks * self.bytes_per_block, memory.total_bytes, cache_blocks,
                         self.block_size, memory.free_bytes)
        self.kv_caches = [hal.zeros(self.backend.kv_cache_shape(cache_blocks), self.backend.kv_cache_dtype)
                          for _ in range(spec.layers_per_plane)]
        log.info("KV cache: %d blocks of %d tokens, %.1f MiB, kv_mode=%s, kv_dtype=%s", self.num_blocks,
                 self.block_size, self.num_blocks * self.bytes_per_block / 2**20, self.layout.kv_mode,
                 kv_dtype or self.dtype)
        self.env = PassEnv(model, self.ops, self.backend, self.kv_caches, self.layout, self.device, self.dtype,
                           self.block_size, self.num_blocks, num_scratch_slots)
        self.graphs: PassGraphs | None = None
        if self.backend.caps.graphs:
            self.graphs = PassGraphs(self.env, hal, config.max_num_seqs, max_model_len, capture=captures)
        # async scheduling refills a decode graph's inputs while the previous step may still run: two
        # copies of each graph, used in turn, so that never touches the replay in flight
        self.num_graph_copies = 2 if config.async_scheduling else 1
        self.num_decode_replays = 0
        # decode rows that persist across steps: a captured step's host work grows with what changed
        self.input_batch = InputBatch(config.max_num_seqs, self.layout.num_planes(max_loops),
                                      math.ceil(max_model_len / self.block_size))
        self.readback = Readback(hal, config.max_num_seqs)       # async scheduling: sampled tokens to host
        self.row_sampling = RowSampling(config.max_num_seqs, self.device)   # the rows' settings on the device
        self.wave_states: dict[tuple[str, int], torch.Tensor] = {}  # wavefront segments' states between steps
        self.prefill_rows: dict[tuple, torch.Tensor] = {}           # captured prefills' sample-row buffers
        self.exit_rows: dict[tuple, ExitRows] = {}                  # captured decodes' early-exit settings
        # early exit inside a captured decode pass: where every loop runs anyway (the KV mode keeps
        # each loop's plane) and the model has an exit gate (Ouro)
        self.captures_exits = (not self.layout.stops_early
                               and type(model).exit_hazard is not LoopedCausalLM.exit_hazard)
        self.packed_rows: dict[tuple, torch.Tensor] = {}            # packed passes' sample-row buffers
        self.packed_seen: set[tuple] = set()                        # packed passes run once, uncaptured
        self.start_capture_s = 0.0
        if captures and hal.caps.graphs and config.capture_at_start:
            self.capture_at_start(max_loops, max_model_len)     # the engine's default depth, as planned

    def forget(self, request_id: str) -> None:
        """Drop what the runner keeps for a request (its persistent row, wavefront states) once it
        finished or lost its KV."""
        self.input_batch.release(request_id)
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
        self.input_batch.sync(blocks)
        if self.is_graph_step(scheduled):
            return self._execute_captured(scheduled, blocks, input_ids_from_device, deferred)
        width = self.prefill_bucket(scheduled)
        if width is not None:
            return self._execute_prefill(scheduled[0], width, blocks, input_ids_from_device, deferred)
        packed = self.packed_step(scheduled)
        if packed is not None:
            return self._execute_packed(scheduled, packed, blocks, input_ids_from_device, deferred)
        split = self.split_step(scheduled)
        if split is not None:
            return self._execute_split(*split, blocks, input_ids_from_device, deferred)
        return self._execute_eager(scheduled, blocks, input_ids_from_device, deferred)

    def _execute_eager(self, scheduled: Sequence[ScheduledRequest], blocks: BlockManager,
                       fed_from: PendingStep | None, deferred: bool) -> StepResult | PendingStep:
        logits, requests, loops, num_rows, prompt = self.eager_pass(scheduled, blocks, fed_from)
        return self.finish_step(logits, requests, loops, num_rows, deferred, prompt, fed_from)

    def finish_step(self, logits: torch.Tensor | None, requests: Sequence, loops: Sequence[int] | torch.Tensor,
                    num_rows: int, deferred: bool, prompt=None, fed_from: PendingStep | None = None,
                    rows=None, positions=None) -> StepResult | PendingStep:
        """Sample `logits: [R, V]` (one row per request of `requests`, from `loops` loops each: host
        ints, or `[R]` on the device where a captured pass chose early exits): to host ints now, or
        `deferred` on the device with an asynchronous copy to host (read by `PendingStep.result()`). Log-
        probabilities, where requests asked (`prompt`: prompt rows and their logits), come along.
        `fed_from`: the step whose tokens are still on the device (penalties count them). A decode
        step over the persistent batch (`rows`, its input `positions`) gathers its sampling settings
        by row and decides stops on the device; the finish codes come back with the tokens."""
        step = codes = None
        if rows is not None and positions is not None and requests:
            step = self.row_sampling.step(self.input_batch.params, rows, positions, logits.shape[-1])
        tokens = self.sample(logits, requests, fed_from, step) if requests else None
        if step is not None:
            codes = step.stop_codes(tokens)
        logprobs = StepLogprobs.compute(logits, tokens, requests, prompt, None if step is None else step.num_logprobs)
        ids = [r.request_id for r in requests]
        if deferred:
            return PendingStep(self.readback, tokens, ids, loops, num_rows, logprobs, rows, codes)
        sampled, prompt_lp = logprobs.to_host() if logprobs is not None else (None, None)
        values = [] if tokens is None else pack_step_values(tokens, codes, loops).tolist()   # one host sync for all
        loops, finish = unpack_step_values(values, ids, codes is not None,
                                           None if isinstance(loops, torch.Tensor) else loops)
        return StepResult(dict(zip(ids, zip(values, loops))), num_rows, sampled, prompt_lp, finish)

    def sample(self, logits: torch.Tensor, requests: Sequence, fed_from: PendingStep | None = None,
               step: StepRows | None = None) -> torch.Tensor:
        """Next tokens `[R]` for `logits: [R, V]`, on the device (runtime/execution/sampler.py); a
        persistent batch's `step` gives its settings gathered by row, unless a row needs its history."""
        if step is not None and not step.per_row:
            return sample(logits, step.sampling_tensors())
        return sample(logits, SamplingTensors.build(requests, self.device, logits.shape[-1], fed_from))
