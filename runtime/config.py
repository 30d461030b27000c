"""Frozen configuration dataclasses: per-request sampling, and the Hydra schemas of the CLIs."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (vLLM's names; the looped-model fields last).

    `temperature=0` is greedy. `top_k <= 0` and `top_p=1` disable those filters. `seed` makes
    sampling (and Huginn's random initial state) reproducible per request, greedy included.
    `num_loops` and `exit_threshold` default to the model's own values when None. `init_scale`
    scales Huginn's random initial state (None: the reference's 1.0; 0.0: a zero state).
    `priority` orders requests under `scheduling_policy="priority"`: lower is more urgent (vLLM's
    convention), first come first served within a level.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    num_loops: int | None = None
    exit_threshold: float | None = None
    min_loops: int = 1
    init_scale: float | None = None
    priority: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        problems = []
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            problems.append(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            problems.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.num_loops is not None and self.num_loops < 1:
            problems.append(f"num_loops must be >= 1, got {self.num_loops!r}")
        if self.exit_threshold is not None and not 0 < self.exit_threshold <= 1:
            problems.append(f"exit_threshold must be in (0, 1], got {self.exit_threshold!r}")
        if self.init_scale is not None and not (self.init_scale >= 0 and math.isfinite(self.init_scale)):
            problems.append(f"init_scale must be >= 0, got {self.init_scale!r}")
        if self.min_loops < 1:
            problems.append(f"min_loops must be >= 1, got {self.min_loops!r}")
        if not isinstance(self.priority, int):
            problems.append(f"priority must be an integer (lower = more urgent), got {self.priority!r}")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


SPECULATIVE_MODES = ("sync", "async")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Self-speculative decoding (runtime/speculation/speculator.py): the model with `draft_loops` loops drafts
    `num_tokens` tokens, the full depth verifies them in one pass. `num_tokens=0` turns it off.
    `mode=async` drafts the next round on a second stream while the current one is verified."""

    num_tokens: int = 0          # draft tokens per round (K); 0 = off
    draft_loops: int = 1         # loops of the draft (Ouro: the step-d head); must be < a request's loops
    mode: str = "sync"           # sync | async

    def __post_init__(self) -> None:
        if not (isinstance(self.num_tokens, int) and self.num_tokens >= 0):
            raise ValueError(f"speculative.num_tokens must be an integer >= 0 (0 = off), got {self.num_tokens!r}")
        if not (isinstance(self.draft_loops, int) and self.draft_loops >= 1):
            raise ValueError(f"speculative.draft_loops must be an integer >= 1, got {self.draft_loops!r}")
        if self.mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative.mode must be one of {', '.join(SPECULATIVE_MODES)}, got {self.mode!r}")

    @property
    def is_enabled(self) -> bool:
        return self.num_tokens > 0


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model: KV layout and memory, batching limits."""

    kv_mode: str = "full"                    # full | last_exited | shared (see runtime/engine/kv_cache.py)
    block_size: Optional[int] = None         # None: the Hal's preferred paged-KV block size
    num_kv_blocks: Optional[int] = None      # explicit pool size; else sized from memory
    kv_cache_memory_bytes: Optional[int] = None   # explicit KV budget; else from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9      # fraction of device memory the process may use in total
    max_num_seqs: int = 256                  # requests running at once
    max_num_batched_tokens: int = 2048       # new tokens per step (prefill chunks included)
    max_model_len: Optional[int] = None      # None: the model's maximum positions
    watermark_blocks: int = 0                # free blocks kept back at admission
    graphs: Optional[bool] = None            # decode graphs; None: on where the Hal captures device work
    fuse_projections: bool = True            # q|k|v and gate|up as one GEMM each (zoo/fuse.py)
    kv_dtype: str = "auto"                   # auto (model dtype) | fp8 (the Hal's) | int8 | fp8_e4m3fn(uz)
    weights_dtype: str = "auto"              # auto (as loaded) | fp8 (per-channel FP8 linears, zoo/fp8.py)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)   # a dict is accepted too
    # scheduling features (docs/scheduling.md)
    enable_prefix_caching: bool = False      # share full KV blocks of equal prefixes between requests
    preemption_mode: str = "recompute"       # recompute (drop KV, prefill again) | swap (KV to host and back)
    swap_space_bytes: int = 4 << 30          # host memory for swapped-out KV (at most the device pool's size)
    scheduling_policy: str = "fcfs"          # fcfs | priority (SamplingParams.priority, lower = first)
    async_scheduling: bool = False           # plan step t+1 while the device runs step t
    wavefront_prefill: bool = False          # long prompts' chunks advance through the loops as a wavefront

    def __post_init__(self) -> None:
        from runtime.engine.planes import KV_MODES

        if not isinstance(self.speculative, SpeculativeConfig):
            object.__setattr__(self, "speculative", SpeculativeConfig(**dict(self.speculative or {})))
        if self.speculative.is_enabled and self.async_scheduling:
            raise ValueError("speculative decoding runs with synchronous scheduling: set async_scheduling=false "
                             "(speculation overlaps its own work with speculative.mode=async)")
        if self.speculative.is_enabled and self.kv_mode == "shared":
            raise ValueError("speculative decoding needs one KV plane per loop (kv_mode=full or last_exited): in "
                             "kv_mode=shared a token's KV depends on how tokens are grouped into steps, so "
                             "verification would not reproduce non-speculative outputs")

        from runtime.execution.quantization import KV_DTYPES, WEIGHTS_DTYPES

        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.weights_dtype not in WEIGHTS_DTYPES:
            raise ValueError(f"weights_dtype must be one of {', '.join(WEIGHTS_DTYPES)}, "
                             f"got {self.weights_dtype!r}")
        if self.kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {', '.join(KV_MODES)}, got {self.kv_mode!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', not {self.scheduling_policy!r}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        # shared mode: the one loop plane holds the final loop's KV, whose value depends on how the
        # prompt was chunked; a cached prefix or a wavefront would change outputs (docs/scheduling.md)
        if self.enable_prefix_caching and self.kv_mode == "shared":
            raise ValueError("enable_prefix_caching needs kv_mode 'full' or 'last_exited': in 'shared' "
                             "mode a block's KV depends on how its prompt was chunked, so a cached prefix "
                             "would change outputs; turn prefix caching off or use kv_mode=full")
        if self.wavefront_prefill and self.kv_mode == "shared":
            raise ValueError("wavefront_prefill needs kv_mode 'full' or 'last_exited': in 'shared' mode "
                             "every loop writes the same plane, so chunks at different loops would overwrite "
                             "each other; turn wavefront_prefill off or use kv_mode=full")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


# ----- Hydra schemas (runtime/cli.py registers them; YAML files in conf/ fill them) -------------
@dataclass
class ModelConfig:
    name: Optional[str] = None            # a known model name (resolved in the local HF cache) or hub id
    path: Optional[str] = None            # a checkpoint folder; wins over name
    dtype: Optional[str] = None           # None: the checkpoint's torch_dtype
    num_loops: Optional[int] = None       # None: the model's default depth
    exit_threshold: Optional[float] = None
    stop_token_ids: list[int] = field(default_factory=list)   # besides the tokenizer's / config's eos
    # sampling defaults from the checkpoint's generation_config; the CLI's values win when set
    temperature: Optional[float] = None   # None: greedy unless the CLI says otherwise
    top_p: Optional[float] = None         # None: 1.0 (off)
    top_k: Optional[int] = None           # None: 0 (off)


@dataclass
class SpeculativeOptions:
    """`speculative.*` on the command line (Hydra needs a mutable node); see `SpeculativeConfig`."""

    num_tokens: int = 0
    draft_loops: int = 1
    mode: str = "sync"


@dataclass
class HalConfig:
    name: str = "auto"
    device_index: Optional[int] = None
    attention_backend: str = "auto"


@dataclass
class ParallelConfig:
    """`parallel.tp=N`: N-way tensor parallelism, one process per rank started by torchrun (every CLI
    that loads a model takes it: generate, bench, serve; see `runtime.parallel.state.init_distributed`)."""

    tp: int = 1
    idle_timeout_s: float = 7 * 24 * 3600.0   # how long ranks > 0 wait for rank 0's next step


@dataclass
class BenchConfig:
    hal: Any = None
    model: Any = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    weights: str = "random"
    dtype: str = "bfloat16"
    workload: Any = "b1"
    kv_mode: str = "full"
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: Optional[int] = None
    async_scheduling: bool = False
    wavefront_prefill: bool = False
    warmup: bool = True
    matmul_size: int = 8192
    output: Optional[str] = None
    log_level: str = "WARNING"
    workloads: Any = None
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    graphs: Optional[bool] = None          # decode graphs; None: on where the Hal captures device work
    kv_dtype: str = "auto"                 # EngineConfig.kv_dtype: auto | fp8 | int8 | fp8_e4m3fn | fp8_e4m3fnuz
    weights_dtype: str = "auto"            # EngineConfig.weights_dtype: auto | fp8


@dataclass
class GenerateConfig:
    hal: Any = None
    model: Any = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    prompt: Any = None                    # a string or a list of strings
    prompt_ids: Any = None                # a list of token ids or a list of such lists
    max_tokens: int = 64
    temperature: Optional[float] = None   # None: the model's default (model.temperature), else greedy
    top_p: Optional[float] = None         # None: model.top_p, else 1.0
    top_k: Optional[int] = None           # None: model.top_k, else 0
    seed: Optional[int] = None
    init_scale: Optional[float] = None    # Huginn's initial-state scale; None: the reference's 1.0
    ignore_eos: bool = False
    chat: bool = False                    # render each prompt as a user turn with the chat template
    enable_thinking: bool = False         # chat: open the assistant turn with <think>
    output: str = "text"                  # text | json
    log_level: str = "WARNING"
    speculative: SpeculativeOptions = field(default_factory=SpeculativeOptions)
    kv_dtype: str = "auto"                # EngineConfig.kv_dtype (docs/fp8.md)
    weights_dtype: str = "auto"           # EngineConfig.weights_dtype (docs/fp8.md)


@dataclass
class ServeConfig:
    hal: Any = None
    model: Any = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    server: Any = None                    # runtime.server.config.ServerConfig's fields
    engine: Any = None                    # EngineConfig's fields
    log_level: str = "INFO"
