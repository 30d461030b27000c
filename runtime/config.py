"""Frozen configuration dataclasses: the engine's settings and the Hydra schemas of the CLIs
(per-request sampling is in runtime/sampling_params.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional


SPECULATIVE_MODES = ("sync", "async")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Self-speculative decoding (runtime/speculation/speculator.py): the model with `draft_loops` loops drafts
    `num_tokens` tokens, the full depth verifies them in one pass. `num_tokens=0` turns it off.
    `mode=async` drafts the next round on a second stream while the current one is verified."""

    num_tokens: int = 0          # draft tokens per round (K); 0 = off
    draft_loops: int = 1         # loops of the draft (Ouro: the step-d head); must be < a request's loops
    mode: str = "sync"           # sync | async
    fuse_round: bool = True      # sync, greedy, uniform rounds: K+1 drafts and the verify in one captured graph

    def __post_init__(self) -> None:
        if not (isinstance(self.num_tokens, int) and self.num_tokens >= 0):
            raise ValueError(f"speculative.num_tokens must be an integer >= 0 (0 = off), got {self.num_tokens!r}")
        if not (isinstance(self.draft_loops, int) and self.draft_loops >= 1):
            raise ValueError(f"speculative.draft_loops must be an integer >= 1, got {self.draft_loops!r}")
        if not isinstance(self.fuse_round, bool):
            raise ValueError(f"speculative.fuse_round must be true or false, got {self.fuse_round!r}")
        if self.mode not in SPECULATIVE_MODES:
            raise ValueError(f"speculative.mode must be one of {', '.join(SPECULATIVE_MODES)}, got {self.mode!r}")

    @property
    def is_enabled(self) -> bool:
        return self.num_tokens > 0


ENGINE_FIELDS_FROM_MODEL = ("default_num_loops",)     # the CLIs take it from model.num_loops


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
    # capture every decode batch bucket and the short prefills when the engine starts (where the Hal
    # records graphs), so no request waits for a capture; false: each on first use
    capture_at_start: bool = True
    fuse_projections: bool = True            # q|k|v and gate|up as one GEMM each (zoo/fuse.py)
    kv_dtype: str = "auto"                   # auto (model dtype) | fp8 (the Hal's) | int8 | fp8_e4m3fn(uz)
    weights_dtype: str = "auto"              # auto (as loaded) | fp8 (per-channel FP8 linears, zoo/fp8.py)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)   # a dict is accepted too
    # scheduling features (docs/scheduling.md)
    enable_prefix_caching: bool = False      # share full KV blocks of equal prefixes between requests
    preemption_mode: str = "recompute"       # recompute (drop KV, prefill again) | swap (KV to host and back)
    swap_space_bytes: int = 4 << 30          # host memory for swapped-out KV (at most the device pool's size)
    scheduling_policy: str = "fcfs"          # fcfs | priority (SamplingParams.priority, lower = first)
    # plan step t+1 while the device runs step t; None: on where the device runs apart from the host
    # and nothing refuses it (speculation, tensor parallelism), off on the CPU (`resolve_async`)
    async_scheduling: Optional[bool] = None
    wavefront_prefill: bool = False          # long prompts' chunks advance through the loops as a wavefront

    max_num_loops: int = 64                  # the deepest num_loops a request (or model.num_loops) may ask for
    # the depth of a request that names none (None: the model's own); the passes captured at start and
    # the KV pool's plan follow it (the CLIs set it from model.num_loops)
    default_num_loops: Optional[int] = None

    def __post_init__(self) -> None:
        """Every bad value is refused with a message that starts with the setting's name (the CLIs
        prefix it with `engine.`) and says what is allowed."""
        from runtime.engine.planes import KV_MODES
        from runtime.execution.quantization import KV_DTYPES, WEIGHTS_DTYPES

        if not isinstance(self.speculative, SpeculativeConfig):
            object.__setattr__(self, "speculative", SpeculativeConfig(**dict(self.speculative or {})))

        def integer(name: str, low: int, optional: bool = False) -> None:
            value = getattr(self, name)
            if optional and value is None:
                return
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                raise ValueError(f"{name} must be an integer >= {low}{' (or null: automatic)' if optional else ''}"
                                 f", got {value!r}")

        def one_of(name: str, allowed: tuple[str, ...]) -> None:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")

        one_of("kv_mode", KV_MODES)
        one_of("kv_dtype", KV_DTYPES)
        one_of("weights_dtype", WEIGHTS_DTYPES)
        one_of("preemption_mode", ("recompute", "swap"))
        one_of("scheduling_policy", ("fcfs", "priority"))
        integer("max_num_seqs", 1)
        integer("max_num_batched_tokens", 1)
        integer("max_num_loops", 1)
        integer("default_num_loops", 1, optional=True)
        if self.default_num_loops is not None and self.default_num_loops > self.max_num_loops:
            raise ValueError(f"default_num_loops={self.default_num_loops} is above max_num_loops="
                             f"{self.max_num_loops}: lower it or raise max_num_loops")
        integer("watermark_blocks", 0)
        integer("swap_space_bytes", 0)
        integer("block_size", 1, optional=True)
        integer("num_kv_blocks", 1, optional=True)
        integer("kv_cache_memory_bytes", 1, optional=True)
        integer("max_model_len", 2, optional=True)
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("async_scheduling", "graphs"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"{name} must be true, false or null (auto), got {getattr(self, name)!r}")
        for name in ("fuse_projections", "enable_prefix_caching", "wavefront_prefill", "capture_at_start"):
            if not isinstance(getattr(self, name), bool):       # "no" would be true
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.speculative.is_enabled and self.async_scheduling:
            raise ValueError("async_scheduling=true does not combine with speculative decoding: set "
                             "async_scheduling=false (speculation overlaps its own work with speculative.mode=async)")
        if self.speculative.is_enabled and self.kv_mode == "shared":
            raise ValueError("speculative.num_tokens > 0 needs one KV plane per loop (kv_mode=full or last_exited): "
                             "in kv_mode=shared a token's KV depends on how tokens are grouped into steps, so "
                             "verification would not reproduce non-speculative outputs")
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


# ----- Hydra schemas (runtime/cli.py registers them; YAML files in conf/ fill them) -------------
@dataclass
class ModelConfig:
    name: Optional[str] = None            # a known model name (resolved in the local HF cache) or hub id
    path: Optional[str] = None            # a checkpoint folder; wins over name
    dtype: Optional[str] = None           # None or "auto": the checkpoint's torch_dtype
    num_loops: Optional[int] = None       # None: the model's default depth
    exit_threshold: Optional[float] = None
    stop_token_ids: list[int] = field(default_factory=list)   # besides the tokenizer's / config's eos
    # sampling defaults from the checkpoint's generation_config; the CLI's values win when set
    temperature: Optional[float] = None   # None: greedy unless the CLI says otherwise
    top_p: Optional[float] = None         # None: 1.0 (off)
    top_k: Optional[int] = None           # None: 0 (off)


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


# The three CLIs compose one `engine:` node (EngineConfig's fields, `runtime/cli.py`'s schema) and
# one `model:` node, so every engine option is spelled the same in each: engine.kv_mode=,
# engine.speculative.num_tokens=, model.dtype= (README "Options").
@dataclass
class BenchConfig:
    hal: Any = None
    model: Any = None
    engine: Any = None                     # EngineConfig's fields (each cell sets max_num_seqs, max_model_len)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    weights: str = "random"
    workload: Any = "b1"
    warmup: bool = True
    matmul_size: int = 8192
    profile: int = 0                       # decode steps of each cell to run under torch.profiler (0: none)
    profile_prefill: bool = False          # run each cell's prefill steps under torch.profiler
    output: Optional[str] = None
    log_level: str = "WARNING"
    workloads: Any = None


@dataclass
class GenerateConfig:
    hal: Any = None
    model: Any = None
    engine: Any = None                    # EngineConfig's fields
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    prompt: Any = None                    # a string or a list of strings
    prompt_ids: Any = None                # a list of token ids or a list of such lists
    max_tokens: int = 64
    temperature: Optional[float] = None   # None: the model's default (model.temperature), else greedy
    top_p: Optional[float] = None         # None: model.top_p, else 1.0
    top_k: Optional[int] = None           # None: model.top_k, else 0
    min_p: Optional[float] = None         # drop tokens below min_p x the top token's probability; 0: off;
                                          # None: the checkpoint's generation_config, else 0
    seed: Optional[int] = None
    n: int = 1                            # samples per prompt (they share the prompt's KV)
    best_of: Optional[int] = None         # generate this many, print the n of highest mean logprob
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: Optional[float] = None   # None: the checkpoint's generation_config, else 1.0 (off)
    logit_bias: Any = None                # {token id: bias}
    min_tokens: int = 0
    stop: Any = None                      # a stop string or a list of them
    logprobs: Optional[int] = None        # output=json: each token's logprob and the top k
    prompt_logprobs: Optional[int] = None
    init_scale: Optional[float] = None    # Huginn's initial-state scale; None: the reference's 1.0
    ignore_eos: bool = False
    chat: bool = False                    # render each prompt as a user turn with the chat template
    enable_thinking: Optional[bool] = None  # chat: True opens the reply with <think>; None: template's
    output: str = "text"                  # text | json
    log_level: str = "WARNING"


@dataclass
class ServeConfig:
    hal: Any = None
    model: Any = None
    engine: Any = None                    # EngineConfig's fields
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    server: Any = None                    # runtime.server.config.ServerConfig's fields
    log_level: str = "INFO"


def resolve_async(config: "EngineConfig", device_type: str, is_parallel: bool) -> "EngineConfig":
    """`async_scheduling=None` decided: on where the device runs apart from the host (a GPU, an NPU)
    and nothing refuses it, so the host plans step t+1 while step t runs (outputs are the same);
    off on the CPU, where there is nothing to overlap, with speculation (it overlaps its own work)
    and under tensor parallelism (rank 0 would plan before it knows the tokens the others replay)."""
    if config.async_scheduling is not None:
        return config
    on = device_type != "cpu" and not config.speculative.is_enabled and not is_parallel
    return dataclasses.replace(config, async_scheduling=on)
