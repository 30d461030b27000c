"""The NVIDIA Hal: torch.cuda streams and events, CUDA graphs sharing one pool, pinned host memory
mapped into the device, NCCL through torch.distributed, Triton attention with the torch reference
as the declared fallback. `RocmHal` reuses all of it through HIP.

Everything here goes through `torch.cuda.*` (not `torch.accelerator`) so torch 2.5 works too.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from hal.attention import AttentionBackend
from hal.base import Caps, Hal, MemInfo
from hal.cuda import attention, driver
from hal.cuda import host_buffer as buffers
from hal.cuda.graph import CudaGraph
from hal.resources import HostBuffer

log = logging.getLogger(__name__)

DECODE_PROJECTIONS_ENV = "LOOPSTACK_DECODE_PROJECTIONS"
FRESH_PREFILL_ENV = "LOOPSTACK_FRESH_PREFILL"
FRESH_PREFILL_CHOICES = ("0", "1", "flash")     # off, the Hal's choice, flash without cuDNN


def fresh_prefill_choice() -> str:
    """`LOOPSTACK_FRESH_PREFILL` (default "1"), refused with the accepted values when misspelt."""
    choice = os.environ.get(FRESH_PREFILL_ENV, "1")
    if choice not in FRESH_PREFILL_CHOICES:
        raise ValueError(f"{FRESH_PREFILL_ENV}={choice!r}: use 0 (the paged kernel), 1 (default) or flash "
                         "(no cuDNN attention)")
    return choice


class DeviceFacts(NamedTuple):
    """What the device properties decide (per vendor), before the Hal adds its own choices."""

    arch: str                                  # "sm_90", "gfx942"
    warp_size: int
    num_compute_units: int                     # SMs / CUs
    fp8_dtype: torch.dtype | None
    dtypes: tuple[torch.dtype, ...]


def cuda_facts(props: Any) -> DeviceFacts:
    """`torch.cuda.get_device_properties` of an NVIDIA GPU -> arch sm_XY, warp 32, FP8 (OCP
    e4m3fn) from Ada/Hopper (sm_89) on, bf16 from Ampere (sm_80) on."""
    capability = (int(props.major), int(props.minor))
    fp8 = torch.float8_e4m3fn if capability >= (8, 9) else None
    has_bf16 = capability >= (8, 0)
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if has_bf16 else (torch.float32, torch.float16)
    arch = f"sm_{capability[0]}{capability[1]}"
    return DeviceFacts(arch, 32, int(props.multi_processor_count), fp8, dtypes)


class CudaHal(Hal):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    backend_order: tuple[str, ...] = ("triton", "torch")
    kv_block_sizes: tuple[int, ...] = (16,)
    graph_collectives: bool = True  # NCCL collectives are capturable in CUDA graphs (tensor-parallel decode)

    def __init__(self, device_index: int | None = None, attention_backend: str = "auto",
                 decode_projections: bool | None = None) -> None:
        attention.check_known(attention_backend, self.backend_order, self.name)
        super().__init__(device_index, attention_backend)
        # the fused decode projections: True for 1-8 rows (hal/kernels/gemv.py; not faster than cuBLAS
        # on an H200 beyond one row), False for none, None (LOOPSTACK_DECODE_PROJECTIONS unset) for one
        # row where the arch's table has the whole-slice kernel and launches chain with PDL
        # (hal/kernels/gemv_slice.py, at the shapes it measured faster than cuBLAS: docs/performance.md, 38),
        # and for the rows of its tensor-core entry's block_m (sm_90: two, lever 127)
        env = os.environ.get(DECODE_PROJECTIONS_ENV)
        self.decode_projections = (decode_projections if decode_projections is not None
                                   else None if env is None else env == "1")
        self._uva: buffers.UvaDecision | None = None
        self._pool: Any = None
        self._capture_stream: Any = None
        self._logged: set[Any] = set()
        self._ops: dict[str, Any] = {}
        self._gemm: tuple[Callable[..., Any] | None] | None = None    # (table_linear's answer,) once asked

    # ----- identity -------------------------------------------------------------------------
    @classmethod
    def is_available(cls) -> bool:
        """A CUDA (not HIP) build of torch that sees a device. torch.cuda.is_available() counts
        devices (NVML or cudaGetDeviceCount) without creating a context; no properties are read."""
        if getattr(torch.version, "hip", None) or not getattr(torch.version, "cuda", None):
            return False
        try:
            return bool(torch.cuda.is_available())
        except Exception:  # a broken driver means "not available", never a crash in detect()
            return False

    def device_facts(self, props: Any) -> DeviceFacts:
        return cuda_facts(props)

    @functools.cached_property
    def facts(self) -> DeviceFacts:
        return self.device_facts(torch.cuda.get_device_properties(self.device()))

    @functools.cached_property
    def caps(self) -> Caps:
        """Read once per device; the first read also runs the UVA probe (see `uva`)."""
        facts = self.facts
        usable = tuple(n for n in self.backend_order if n != "triton" or attention.triton_status()[0])
        return Caps(arch=facts.arch, warp_size=facts.warp_size, num_compute_units=facts.num_compute_units,
                    graphs=True, graph_needs_host_update=False, graph_collectives=self.graph_collectives,
                    uva=self.uva().is_mapped,
                    attention_backends=usable, kv_block_sizes=self.kv_block_sizes, head_dims=None,
                    fp8_dtype=facts.fp8_dtype, dtypes=facts.dtypes,
                    kv_quant_dtypes=(facts.fp8_dtype,) if facts.fp8_dtype is not None else ())

    # ----- device and streams ---------------------------------------------------------------
    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, index: int) -> None:
        self.device_index = index
        torch.cuda.set_device(index)
        for cached in ("facts", "caps"):
            self.__dict__.pop(cached, None)
        self._uva, self._capture_stream = None, None
        self._ops, self._gemm = {}, None         # ops bound to the old device (its cuBLASLt handle)

    def stream(self, priority: int = 0) -> Any:
        return torch.cuda.Stream(device=self.device(), priority=priority)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device())

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def event(self, enable_timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=enable_timing)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device())

    # ----- allocator ------------------------------------------------------------------------
    def mem_info(self) -> MemInfo:
        free_bytes, total_bytes = torch.cuda.mem_get_info(self.device())
        return MemInfo(int(free_bytes), int(total_bytes))

    def memory_stats(self) -> dict[str, int]:
        dev = self.device()
        return {"allocated": torch.cuda.memory_allocated(dev), "reserved": torch.cuda.memory_reserved(dev),
                "peak_allocated": torch.cuda.max_memory_allocated(dev)}

    def reset_peak_memory(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device())

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def host_device_pointer(self, host_ptr: int) -> int:
        """Device address of pinned host memory (cudaHostGetDevicePointer)."""
        return driver.cuda_host_device_pointer(host_ptr)

    def uva(self) -> buffers.UvaDecision:
        """Whether host buffers are mapped (zero-copy) or staged, decided once: the environment
        override `LOOPSTACK_UVA`, else a probe on the device (see `host_buffer.probe_mapping`)."""
        if self._uva is None:
            self._uva = buffers.decide_uva(os.environ.get(buffers.UVA_ENV), self._probe_uva)
            log.info("hal %s: host buffers are %s: %s", self.name,
                     "mapped (zero-copy)" if self._uva.is_mapped else "staged copies", self._uva.reason)
        return self._uva

    def _probe_uva(self) -> buffers.UvaDecision:
        return buffers.probe_mapping(self._mapped_buffer)

    def _mapped_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> buffers.MappedHostBuffer:
        return buffers.MappedHostBuffer(shape, dtype, self.device(), self.host_device_pointer)

    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> HostBuffer:
        if self.uva().is_mapped:
            return self._mapped_buffer(shape, dtype)
        return buffers.StagedHostBuffer(shape, dtype, self.device())

    # ----- graphs ---------------------------------------------------------------------------
    def graph_pool(self) -> Any:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def graph(self) -> CudaGraph:
        """A new graph with a private memory pool; the caller warms `fn` up before `capture(fn)`.
        (Sharing one pool between graphs tripped an allocator assertion in torch 2.11 when graphs of
        several engines were freed in arbitrary order; a decode graph's private memory is small.)"""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(device=self.device())
        return CudaGraph(self.device(), None, self._capture_stream)

    # ----- attention and kernels ------------------------------------------------------------
    def attention(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  block_size: int | None = None, backend: str | None = None,
                  kv_dtype: torch.dtype | None = None) -> AttentionBackend:
        choice = attention.choose(backend or self.attention_backend_name, self.backend_order, head_dim, dtype,
                                  self.name, kv_dtype)
        self._log_once(("attention", choice, num_heads, num_kv_heads),
                       "hal %s (%s): attention %s for H=%d KVH=%d: %s",
                       self.name, self.facts.arch, choice.name, num_heads, num_kv_heads, choice.reason)
        configs = self.kernel_configs() if choice.name == "triton" else None
        return attention.build(choice.name, num_heads, num_kv_heads, head_dim, dtype, self.device(),
                               block_size or self.kv_block_sizes[0], configs, kv_dtype, self.fresh_prefill())

    def fresh_prefill(self) -> str | None:
        """How the Triton backend attends prefill chunks without context (hal/kernels/fresh.py):
        torch's varlen flash kernel from Ampere on; on Hopper cuDNN's for one prompt of as many KV heads as
        heads, every other batch on the paged kernel over its own K/V (`LOOPSTACK_FRESH_PREFILL=0`: the paged
        kernel always; `=flash`: flash instead of cuDNN)."""
        choice = fresh_prefill_choice()
        if choice == "0":
            return None
        sm = int(self.facts.arch.removeprefix("sm_").rstrip("a"))
        if sm >= 90 and choice != "flash":
            return "cudnn"
        return "flash" if sm >= 80 else "sdpa"

    def kernel_configs(self) -> dict[str, Any]:
        """Triton launch configs for this device's arch (`hal.kernels.configs.configs_for`):
        the Hal chooses them, the kernels' callers never do."""
        return attention.kernel_configs(self.facts.arch)

    def speed_notes(self, kv_quantized: bool, fp8_weights: bool) -> list[str]:
        from hal.cuda.fp8 import speed_notes

        return speed_notes(self.facts.arch, kv_quantized, fp8_weights)

    def op(self, name: str) -> Callable[..., Any] | None:
        if name not in self._ops:
            has_triton = attention.triton_status()[0]
            configs = self.kernel_configs() if has_triton else None
            if name == "fp8_linear":          # torch._scaled_mm or the Triton W8A16 kernel (hal/cuda/fp8.py)
                from hal.cuda.fp8 import fp8_linear_op

                has_fp8 = self.facts.fp8_dtype is not None
                self._ops[name] = fp8_linear_op(self.facts.arch, configs, has_triton) if has_fp8 else None
            elif name == "silu_mul_fp8_linear":   # SwiGLU in the prologue of fp8_linear's decode GEMV
                from hal.cuda.fp8 import silu_mul_fp8_linear_op

                # decode_projections=False asks for the separate small ops, before FP8 weights too
                linear, silu = self.op("fp8_linear"), self.op("silu_and_mul")
                self._ops[name] = (silu_mul_fp8_linear_op(self.facts.arch, configs, linear, silu)
                                   if linear is not None and silu is not None and self.decode_projections
                                   is not False else None)
            elif name == "norm_add_norm_fp8":     # a boundary quantizing its output for `_scaled_mm`
                from hal.cuda.fp8 import norm_add_norm_fp8_op

                has_fp8 = self.facts.fp8_dtype is not None and self.op("norm_add_norm") is not None
                self._ops[name] = norm_add_norm_fp8_op(self.facts.arch, configs) if has_fp8 else None
            elif name in attention.GEMV_OPS:
                rows = self._projection_rows(configs) if has_triton else 0
                self._ops[name] = (attention.fused_op(name, configs, self.facts.num_compute_units, rows,
                                                      self._table_linear()) if rows else None)
            else:
                self._ops[name] = attention.fused_op(name, configs)
        return self._ops[name]

    def _table_linear(self) -> Callable[..., Any] | None:
        """The decode projections' product: cuBLASLt at the measured algorithms of this device and
        library (hal/cuda/blaslt.py), or None for `F.linear` (no table for them, `LOOPSTACK_BLASLT=0`);
        on sm_90, one-row products of the shapes hal/cuda/ring_gemv.py's table names on its TMA ring."""
        if self._gemm is None:
            from hal.cuda.blaslt import table_linear

            product = table_linear(self.device()) if self.device().type == "cuda" else None
            library = product or torch.nn.functional.linear
            ringed = self._ring_or(library)
            self._gemm = (product if ringed is library else ringed,)
        return self._gemm[0]

    def _ring_or(self, library: Callable[..., Any]) -> Callable[..., Any]:
        """`library`, or the ring wrapped around it where its table (or LOOPSTACK_RING_GEMV=1) has shapes:
        on an sm_90 device (a simulated one has no TMA) whose Triton has Gluon's Hopper ops (3.6 or newer)."""
        if self.facts.arch != "sm_90" or self.device().type != "cuda":
            return library
        try:
            from hal.cuda.ring_gemv import ring_or
        except (ImportError, AttributeError) as e:    # no Gluon, or one whose names the module does not know
            self._log_once("ring", "the TMA ring projections need Gluon (Triton >= 3.6): %s", e)
            return library
        from hal.kernels import pdl

        return ring_or(library, self.facts.arch, pdl.enabled(self.device()))

    def _projection_rows(self, configs: dict[str, Any]) -> int:
        """Rows up to which the decode projections run fused (0: cuBLAS and the separate small ops)."""
        if self.decode_projections is not None:
            return attention.GEMV_MAX_ROWS if self.decode_projections else 0
        from hal.kernels import pdl
        from hal.kernels.gemv_ops import SLICE_KEY

        return 1 if SLICE_KEY in configs and pdl.enabled(self.device()) else 0

    def _log_once(self, key: Any, message: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.info(message, *args)
