"""The hardware abstraction layer: what every vendor implements.

The HAL answers only "how does this hardware do X". Configuration (batch sizes, KV modes, graph
buckets) lives in `runtime/`; models live in `zoo/`. A vendor implements `Hal` plus one or more
`AttentionBackend`s; streams, events and memory default to `torch.accelerator` where it serves.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, NamedTuple, Protocol, Sequence

import torch


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


class HostBuffer(Protocol):
    """A buffer the host writes and the device reads (step metadata: block tables, lengths).

    `host` is a CPU tensor to write into. After writing rows, call `mark_dirty(lo, hi)` and then
    `device_view()` returns a device tensor with those contents: a zero-copy alias on CUDA/ROCm
    (mapped pinned memory), an asynchronous staged copy of the dirty rows on Ascend, the same
    tensor on the CPU. The device view's address never changes, so graphs may capture it.
    """

    host: torch.Tensor

    def mark_dirty(self, lo: int = 0, hi: int | None = None) -> None: ...

    def device_view(self) -> torch.Tensor: ...


class Graph(Protocol):
    """A captured sequence of device work over static buffers.

    `capture(fn)` records `fn()` and returns its outputs: tensors that every replay overwrites in
    place (a device graph records without running, so they hold values only after a replay; call
    `fn()` once eagerly before capturing, for lazy initialisation). `replay()` re-issues the same work. `update(host_params)` pushes
    new host-side arguments into the captured work before a replay: a no-op where kernels read
    lengths from device memory (CUDA/ROCm), required on Ascend where fused attention takes lengths
    as host lists. On the CPU, replay re-runs `fn` eagerly and copies into the captured outputs.
    """

    def capture(self, fn: Callable[[], Any]) -> Any: ...

    def replay(self) -> None: ...

    def update(self, host_params: Sequence[dict[str, Any]]) -> None: ...


class Comm(Protocol):
    """Collectives over one torch.distributed process group (nccl / rccl / hccl / gloo).

    All ops are in place on `tensor`/`out` and synchronous with respect to the current stream.
    """

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor: ...

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor: ...

    def send(self, tensor: torch.Tensor, dst: int) -> None: ...

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...

    def barrier(self) -> None: ...


class AttnCaps(NamedTuple):
    packed_prefill: bool      # varlen queries of many sequences in one call
    graphs: bool              # safe to capture (no host syncs, static metadata buffers)
    reason: str               # why this backend was chosen (logged once at start)


class PagedBatch(NamedTuple):
    """Host description of one attention batch over the paged cache (host values, no tensors).

    Sequence i contributes `query_lens[i]` new tokens, the last ones of its `seq_lens[i]` tokens,
    so the new tokens sit at positions `seq_lens[i] - query_lens[i] ... seq_lens[i] - 1`. Tokens
    are packed sequence after sequence ("varlen", no padding). `block_tables[p][i]` lists the
    cache blocks of sequence i in KV plane p; every plane shares one block pool. The tables are
    either nested lists, or (a runtime's persistent batch) one int32 array `[P, S, B]` whose rows are
    valid up to `table_lengths[p, i]` (then `table_lengths` is given; read both through
    `hal.common.paged`). `query_lens` and `seq_lens` may be int arrays.
    """

    query_lens: Sequence[int]
    seq_lens: Sequence[int]
    block_tables: Sequence[Sequence[Sequence[int]]]   # [plane][seq][block], or int32 [P, S, B]
    block_size: int
    table_lengths: Any = None                          # int [P, S] when block_tables is an array


class MetaCapacity(NamedTuple):
    """Static sizes of metadata that graphs capture: `update_meta` refills it in place for any batch
    within these bounds, so captured kernels keep reading the same addresses."""

    max_num_seqs: int
    max_num_tokens: int
    max_blocks_per_seq: int
    num_planes: int
    max_seq_len: int


class AttentionBackend(ABC):
    """Paged attention for one model shape (heads, kv heads, head dim, dtype), chosen by the Hal.

    Layout of the KV cache (one tensor per attention layer of a plane) is the backend's business:
    callers allocate `torch.empty(kv_cache_shape(...))` and only pass it back. `build_meta` turns a
    `PagedBatch` into whatever the kernels need once per step; `forward` and `write_kv` then take a
    plane index so that all loops and layers share that one metadata object.

    `kv_dtype` (an 8-bit format of `hal.common.kv_quant.QUANT_MAX`, or None for `dtype`) quantizes the cache:
    `write_kv` stores each token's K and V with one scale per KV head, `forward` dequantizes on load,
    `read_kv` returns dequantized values; caches are then raw bytes (`kv_cache_dtype` uint8) in
    `kv_layout` unless the backend documents its own.
    """

    name: ClassVar[str]

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, block_size: int, *, kv_dtype: torch.dtype | None = None) -> None:
        from hal.common.kv_quant import RowLayout, is_quantized

        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if kv_dtype not in (None, dtype) and not is_quantized(kv_dtype):
            raise ValueError(f"kv_dtype {kv_dtype}: a quantized cache takes float8_e4m3fn, float8_e4m3fnuz or "
                             f"int8; None keeps the model dtype {dtype}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype, self.device, self.block_size = dtype, device, block_size
        self.kv_dtype = kv_dtype or dtype
        self.kv_layout = RowLayout(num_kv_heads, head_dim, kv_dtype) if is_quantized(kv_dtype) else None

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The dtype to allocate `kv_cache_shape` in: the model dtype, or uint8 bytes when quantized."""
        return torch.uint8 if self.kv_layout is not None else self.dtype

    @property
    @abstractmethod
    def caps(self) -> AttnCaps: ...

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's K+V cache holding `num_blocks` blocks of `block_size` tokens."""

    @abstractmethod
    def build_meta(self, batch: PagedBatch, capacity: MetaCapacity | None = None) -> Any:
        """Device metadata for one step: query offsets, lengths, per-plane block tables and slot
        mappings. Built once, shared by every loop and layer of the step. With `capacity` the
        tensors are sized for it (for graphs; see `update_meta`)."""

    def update_meta(self, meta: Any, batch: PagedBatch) -> list[dict[str, Any]]:
        """Refill `meta` (built with a capacity) in place for `batch`, keeping every device address.
        Returns the host-side parameters captured graphs need refreshed (`Graph.update`): [] where
        kernels read lengths from device memory. Backends without graph support raise."""
        raise NotImplementedError(f"attention backend {self.name!r} cannot run in captured graphs")

    def advance_meta(self, meta: Any, steps: int) -> Any | None:
        """The metadata of a decode batch (one query token per sequence) `steps` positions further on:
        every sequence one token longer per step, each token's slot the next of its table. Computed
        on the device from `meta` (capturable in the same graph: speculation's draft passes chain this
        way), equal to `build_meta` of the advanced batch wherever the tables reach the new positions.
        None where lengths live on the host (then each pass needs its own `update_meta`)."""
        return None

    @abstractmethod
    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: Any, plane: int) -> None:
        """Store the step's new keys/values `k, v: [T, KVH, D]` into plane `plane` of `kv_cache`."""

    @abstractmethod
    def forward(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: Any, plane: int,
                scale: float) -> torch.Tensor:
        """Causal attention of the packed queries `q: [T, H, D]` over plane `plane` (which
        already holds this step's keys). Returns `[T, H, D]` in q's dtype."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
               plane: int, scale: float) -> torch.Tensor:
        """`write_kv(k, v)` then `forward(q)`: what a layer does each step. A backend may attend over
        the fresh `k, v` directly where the plane holds nothing older for any sequence (prefill
        without context), as long as the result is the same attention."""
        self.write_kv(k, v, kv_cache, meta, plane)
        return self.forward(q, kv_cache, meta, plane, scale)

    def write_kv_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: Any,
                        plane: int, positions: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor | None:
        """Rotary embedding of `q: [T, H, D]` and `k: [T, KVH, D]` at `positions: [T]` (NeoX halves,
        or adjacent pairs when `interleaved`) and `write_kv` of the rotated k and v, in one kernel;
        returns the rotated q. None where the backend has no such kernel for this cache or batch:
        the caller then rotates and calls `attend`."""
        return None

    def slot_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache as `[2, num_blocks * block_size, ...]` (K then V, everything one slot stores:
        `[KVH, D]` values, or a quantized cache's byte row); the default fits every layout whose
        blocks are contiguous runs of slots."""
        if self.kv_layout is not None:
            return kv_cache.view(2, -1, kv_cache.shape[-1])
        return kv_cache.view(2, -1, self.num_kv_heads, self.head_dim)

    def read_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[N, KVH, D]` stored at `slots: [N]` (dequantized, in the model dtype)."""
        if self.kv_layout is not None:
            return (self.kv_layout.read_slots(kv_cache, 0, slots, self.dtype),
                    self.kv_layout.read_slots(kv_cache, 1, slots, self.dtype))
        view = self.slot_view(kv_cache)
        return view[0].index_select(0, slots), view[1].index_select(0, slots)

    def block_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Views of everything the cache stores, each `[2, num_blocks, ...]` (dim 1 = block): what
        swap copies to host and back. The default fits every slot-major layout."""
        view = self.slot_view(kv_cache)
        return (view.unflatten(1, (-1, self.block_size)),)

    def copy_kv(self, kv_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy the KV of `src_slots` to `dst_slots` (early-exit fill into the planes a token skipped)."""
        view = self.slot_view(kv_cache)
        view[:, dst_slots] = view[:, src_slots]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                    causal: bool = True) -> torch.Tensor:
    """torch SDPA with GQA expansion and a bottom-right causal mask. Shapes as `AttentionBackend.dense`."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads != num_kv_heads:
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    q_len, kv_len = q.shape[2], k.shape[2]
    if causal and q_len == kv_len:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    if q_len == 1:   # one query at the end sees every key (and torch's CPU SDPA is slow with a 1-row mask)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    mask = None
    if causal:
        # bottom-right: query i sees keys 0 .. kv_len - q_len + i
        mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(kv_len - q_len)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


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
        - `add_rms_norm(x, residual, weight, eps) -> (y, s)`: `s = x + residual`, `y = norm(s)`
          (pre-norm layers: the residual stream and the next sublayer's input in one pass).
        - `fp8_linear(x, weight, weight_scale, bias=None) -> y`: `x: [M, K]` (bf16/fp16/fp32) times
          FP8 `weight: [N, K]` (`caps.fp8_dtype`) dequantized per output channel by `weight_scale: [N]`
          float32, float32 accumulation, `+ bias`, `y: [M, N]` in x's dtype. An implementation may
          also quantize x per row to FP8 (W8A8 through `torch._scaled_mm`); it says so in its docs.

        Decode projections (a small op folded into the matrix product that follows or precedes it;
        `x: [..., K]`, `weight: [N, K]`, results `[..., N]` in x's dtype; `norm` is `rms_norm` above):
        - `linear(x, weight, residual=None) -> y`: `F.linear(x, weight)`, with `residual`
          `residual + F.linear(x, weight)`.
        - `rms_norm_linear(x, norm_weight, eps, weight) -> y`: `F.linear(norm(x, norm_weight, eps), weight)`.
        - `silu_mul_linear(x, weight, residual=None) -> y`: `F.linear(silu_and_mul(x), weight)`
          (`x: [..., 2K]`), with `residual` `residual + ...`.
        - `norm_residual_linear(x, residual, post_norm_weight, norm_weight, eps, weight, sum_first=False)
          -> (y, h)`: the residual stream `h = residual + norm(x, post_norm_weight, eps)` (sandwich
          norms: Ouro), or with `sum_first` `h = norm(x + residual, post_norm_weight, eps)` (Huginn), and
          `y = F.linear(norm(h, norm_weight, eps), weight)`.
        Each rounds where the torch expression rounds (every intermediate in x's dtype); the fused
        products accumulate in float32 in their own order, so bf16 results differ from the unfused
        path's by the rounding of that order. Implementations may run the unfused expression for
        shapes and dtypes they do not fuse (the CUDA/ROCm ones: float32, or more than 8 rows).
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device()})"
