"""The hardware abstraction layer: what every vendor implements.

The HAL answers only "how does this hardware do X". Configuration (batch sizes, KV modes, graph
buckets) lives in `runtime/`; models live in `zoo/`. A vendor implements `Hal` (here, with the data
it reports: `Caps`, `MemInfo`) plus one or more `AttentionBackend`s (hal/attention.py); its host
buffers, graphs and collectives follow the protocols of hal/resources.py. Streams, events and memory
default to `torch.accelerator` where it serves.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, NamedTuple, Sequence

import torch

from hal.attention import AttentionBackend, dense_attention
from hal.resources import Comm, Graph, HostBuffer


@dataclass(frozen=True)
class Caps:
    """What the hardware and this Hal can do; data, so callers never test vendor names."""

    arch: str                                  # "cpu", "sm_90", "gfx942", "Ascend910B3"
    warp_size: int | None = None               # 32 (NVIDIA), 64 (CDNA), None (CPU, Ascend)
    num_compute_units: int = 1                 # SMs / CUs / AI cores / CPU threads
    graphs: bool = False                       # Graph.capture records device work (not eager replay)
    graph_needs_host_update: bool = False      # Ascend: lengths are host values baked into graphs
    graph_collectives: bool = False            # graphs may capture collectives on dist_backend (NCCL)
    uva: bool = False                          # host_buffer is zero-copy mapped into the device
    attention_backends: tuple[str, ...] = ()   # in order of preference
    kv_block_sizes: tuple[int, ...] = (16,)    # paged-KV block sizes the backends take; first = default
    head_dims: tuple[int, ...] | None = None   # head dims the fast attention path takes; None = any
    fp8_dtype: torch.dtype | None = None       # e4m3fn (H100/H200, gfx950), e4m3fnuz (gfx942)
    kv_quant_dtypes: tuple[torch.dtype, ...] = ()   # 8-bit KV formats attention reads (hal/common/kv_quant.py)
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


class MemInfo(NamedTuple):
    free_bytes: int
    total_bytes: int


class Hal(ABC):
    """One vendor's answers. Instances are cheap to construct; device work happens on first use.

    Members (about 25): identity (`name`, `device_type`, `dist_backend`, `visible_devices_env`,
    `is_available`, `caps`, `versions`), device and streams (`device`, `device_count`, `set_device`,
    `stream`, `current_stream`, `event`, `synchronize`), allocator (`mem_info`, `memory_stats`,
    `empty_cache`, `host_buffer`, `host_tensor`), graphs (`graph`, `graph_pool`), collectives (`comm`), attention
    (`attention`, `dense`), optional fused ops (`op`).
    """

    name: ClassVar[str]                  # registry name: "cpu", "cuda", "rocm", "ascend"
    device_type: ClassVar[str]           # torch device type: "cpu", "cuda" (also ROCm), "npu"
    dist_backend: ClassVar[str]          # torch.distributed backend: gloo, nccl (rccl), hccl
    visible_devices_env: ClassVar[str | None] = None

    def __init__(self, device_index: int | None = None, attention_backend: str = "auto") -> None:
        self.device_index = device_index
        self.attention_backend_name = attention_backend

    # ----- identity -------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this vendor's hardware and software are present. Must not initialise the
        device runtime (torch_npu, for one, can only be initialised once per process)."""

    @property
    @abstractmethod
    def caps(self) -> Caps: ...

    @classmethod
    def substitute(cls) -> str | None:
        """Another registered Hal to build instead of this one (`hal.get` follows it), e.g. the
        Ascend simulation when `LOOPSTACK_ASCEND_SIM=1`; None: this one."""
        return None

    # ----- device and streams ---------------------------------------------------------------
    def device(self, index: int | None = None) -> torch.device:
        """The torch device this Hal computes on (index defaults to the configured one)."""
        index = self.device_index if index is None else index
        return torch.device(self.device_type, index if index is not None else 0)

    def device_count(self) -> int:
        return torch.accelerator.device_count() if torch.accelerator.is_available() else 0

    def set_device(self, index: int) -> None:
        self.device_index = index
        torch.accelerator.set_device_index(index)

    def stream(self, priority: int = 0) -> Any:
        """A new stream on this device (`torch.Stream`)."""
        return torch.Stream(device=self.device(), priority=priority)

    def current_stream(self) -> Any:
        return torch.accelerator.current_stream(self.device())

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        """Make `stream` current inside the block."""
        with stream:
            yield

    def event(self, enable_timing: bool = False) -> Any:
        """A new `torch.Event` (record / wait / synchronize / elapsed_time)."""
        return torch.Event(device=self.device(), enable_timing=enable_timing)

    def synchronize(self) -> None:
        torch.accelerator.synchronize(self.device())

    # ----- allocator ------------------------------------------------------------------------
    @abstractmethod
    def mem_info(self) -> MemInfo:
        """Free and total device memory in bytes."""

    def memory_stats(self) -> dict[str, int]:
        """`allocated`, `reserved` and `peak_allocated` bytes of this process on the device."""
        dev = self.device()
        return {"allocated": torch.accelerator.memory_allocated(dev),
                "reserved": torch.accelerator.memory_reserved(dev),
                "peak_allocated": torch.accelerator.max_memory_allocated(dev)}

    def reset_peak_memory(self) -> None:
        torch.accelerator.reset_peak_memory_stats(self.device())

    def empty_cache(self) -> None:
        torch.accelerator.empty_cache()

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor on the device, for pools that may take most of it (the KV cache)."""
        return torch.zeros(tuple(shape), dtype=dtype, device=self.device())

    @abstractmethod
    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> HostBuffer:
        """A host-written, device-readable buffer (see `HostBuffer`)."""

    def host_tensor(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device copies to and from asynchronously (`copy_(..., non_blocking=True)`):
        page-locked where the device is not the host (KV swap space, sampled-token readback)."""
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=self.device_type != "cpu")

    # ----- graphs ---------------------------------------------------------------------------
    @abstractmethod
    def graph(self) -> Graph:
        """A new graph that shares this Hal's memory pool with the others (see `Graph`)."""

    def graph_pool(self) -> Any:
        """The shared graph memory pool handle (None where pools do not apply)."""
        return None

    # ----- collectives ----------------------------------------------------------------------
    def comm(self, group: Any = None) -> Comm:
        """Collectives over `group` (default: the world group) on `dist_backend`."""
        from hal.common.comm import TorchDistComm

        return TorchDistComm(group)

    # ----- attention ------------------------------------------------------------------------
    @abstractmethod
    def attention(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  block_size: int | None = None, backend: str | None = None,
                  kv_dtype: torch.dtype | None = None) -> AttentionBackend:
        """The attention backend for this model shape; `kv_dtype` one of `caps.kv_quant_dtypes`
        quantizes the KV cache (None: the model dtype).

        `backend` (or the Hal's configured `attention_backend`) names one of
        `caps.attention_backends`; "auto" takes the first that accepts the shape. The choice and
        its reason are logged once; an explicit request that cannot be met raises, and nothing
        falls back silently at run time.
        """

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
              causal: bool = True) -> torch.Tensor:
        """Differentiable attention without a cache, `q: [B, H, T, D]`, `k, v: [B, KVH, S, D]`.

        Causal masking is bottom-right aligned (query i attends keys up to S - T + i), so a
        suffix of queries against a longer key history works too. Used for training and for the
        reference path; defaults to torch SDPA, which every vendor's torch provides.
        """
        return dense_attention(q, k, v, scale=scale, causal=causal)

    def versions(self) -> dict[str, str]:
        """Vendor software versions worth reporting (driver, toolkit, plugin); the conformance CLI
        prints them. Empty where torch's own version says it all."""
        return {}

    def speed_notes(self, kv_quantized: bool, fp8_weights: bool) -> list[str]:
        """Where an option asked for is measured slower on this device than leaving it off, one line
        each naming the faster setting (the engine logs them once at start). Empty where nothing
        was measured against."""
        return []

    # ----- optional fused ops ---------------------------------------------------------------
    def op(self, name: str) -> Callable[..., Any] | None:
        """A fused op by name, or None: callers then use the plain torch expression. The names and
        their meaning are the same on every Hal:

        - `rms_norm(x, weight, eps, residual=None) -> y`: Llama RMSNorm of `x: [..., X]` (float32
          statistics, cast to x's dtype, then `* weight`); with `residual`, `residual + norm(x)`
          (the post-norm residual add of sandwich-norm layers), one tensor either way.
        - `rotary(q, k, positions, theta, interleaved) -> (q, k)`: `q: [T, H, D]`, `k: [T, KVH, D]`,
          `positions: [T]`; NeoX halves, or GPT-J adjacent pairs when `interleaved`. May rotate in
          place; callers use the returned tensors.
        - `silu_and_mul(x) -> y`: `x: [..., 2I]` -> `silu(x[..., :I]) * x[..., I:]`.
        - `norm_add_norm(x, residual, post_weight, weight, eps, sum_first=False) -> (y, h)`: a
          sublayer boundary in one pass, the residual stream h and the next sublayer's input
          `y = norm(h, weight, eps)`: `h = residual + norm(x, post_weight, eps)` (sandwich norms:
          Ouro), with `sum_first` `h = norm(x + residual, post_weight, eps)` (Huginn), with
          `post_weight=None` `h = residual + x` (pre-norm layers).
        - `fp8_linear(x, weight, weight_scale, bias=None) -> y`: `x: [M, K]` (bf16/fp16/fp32) times
          FP8 `weight: [N, K]` (`caps.fp8_dtype`) dequantized per output channel by `weight_scale: [N]`
          float32, float32 accumulation, `+ bias`, `y: [M, N]` in x's dtype. An implementation may
          also quantize x per row to FP8 (W8A8 through `torch._scaled_mm`); it says so in its docs.
        - `norm_add_norm_fp8(x, residual, post_weight, weight, eps, sum_first=False) -> (rows, h) | None`:
          offered where `fp8_linear` quantizes x per row: `norm_add_norm` with y as `QuantizedRows`
          (hal/common/quantized_rows.py), the bytes `fp8_linear` would make of y, which `fp8_linear`
          then takes as its x; None for operands whose product would not quantize them (the caller
          runs `norm_add_norm`). `fp8_linear` of those rows equals `fp8_linear` of y, up to the last
          bits of a row statistic a kernel may sum in another order.

        Decode projections (a small op folded into the matrix product that follows or precedes it;
        `x: [..., K]`, `weight: [N, K]`, results `[..., N]` in x's dtype; `norm` is `rms_norm` above):
        - `linear(x, weight, residual=None) -> y`: `F.linear(x, weight)`, with `residual`
          `residual + F.linear(x, weight)`.
        - `rms_norm_linear(x, norm_weight, eps, weight) -> y`: `F.linear(norm(x, norm_weight, eps), weight)`.
        - `silu_mul_linear(x, weight, residual=None) -> y`: `F.linear(silu_and_mul(x), weight)`
          (`x: [..., 2K]`), with `residual` `residual + ...`.
        - `silu_mul_fp8_linear(x, weight, weight_scale, residual=None) -> y`: the same with an FP8
          weight, `fp8_linear(silu_and_mul(x), weight, weight_scale)` (`+ residual`); offered with
          `fp8_linear`, and rounds as that op does.
        - `norm_residual_linear(x, residual, post_norm_weight, norm_weight, eps, weight, sum_first=False)
          -> (y, h)`: the residual stream `h = residual + norm(x, post_norm_weight, eps)` (sandwich
          norms: Ouro), or with `sum_first` `h = norm(x + residual, post_norm_weight, eps)` (Huginn), and
          `y = F.linear(norm(h, norm_weight, eps), weight)`.
        - `projection_takes(rows, k, after_norm=False) -> bool`: whether the ops above fuse a product
          of `rows` rows of K (one that normalises its input: `after_norm`); where they do not they
          run the unfused expression, and a pre-norm layer then keeps its `norm_add_norm` boundaries.
        Each rounds where the torch expression rounds (every intermediate in x's dtype); the fused
        products accumulate in float32 in their own order, so bf16 results differ from the unfused
        path's by the rounding of that order. Implementations may run the unfused expression for
        shapes and dtypes they do not fuse (the CUDA/ROCm ones: float32, or more than 8 rows; the CUDA
        one by default one row at the shapes its whole-slice kernel measured faster at).
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device()})"
