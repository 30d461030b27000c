"""The Ascend Hal (910B through torch_npu).

`AscendHal()` drives an NPU: torch.npu streams/events/memory, NPUGraph with host-parameter
updates, HCCL, a staged host buffer, fused-infer attention. torch_npu is imported lazily, on first
device use. Its CPU simulation is a Hal of its own, `hal=ascend-sim` (`hal/ascend/sim/`); env
`LOOPSTACK_ASCEND_SIM=1` makes `hal=ascend` mean it (`AscendHal.substitute`).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Sequence

import torch

from hal.ascend import detect
from hal.ascend.attention import FallbackAttention, FusedAttention
from hal.ascend.fused import make_op
from hal.ascend.graph import NpuGraph
from hal.ascend.ops import AscendOps
from hal.attention import AttentionBackend
from hal.base import Caps, Hal, MemInfo
from hal.common.host_buffer import StagedHostBuffer

log = logging.getLogger(__name__)

BLOCK_SIZE = 128                                  # the fused op's page size (128..512, multiples of 128)
FUSED_HEAD_DIMS = (128,)                          # TND without rope: Q_D = K_D = V_D = 128
FUSED_DTYPES = (torch.bfloat16, torch.float16)
BACKENDS = ("fia", "fia_pa", "torch")
KV_QUANT_DTYPES = (torch.int8,)                   # the fused op's KV antiquant takes int8 (no FP8 on 910B)


def _import_torch_npu() -> Any:
    try:
        import torch_npu  # noqa: F401  (registers the "npu" device and torch.npu)
    except ImportError as exc:
        raise RuntimeError(f"hal 'ascend' needs torch_npu with CANN: {exc}. Install the torch-npu release "
                           f"that matches your torch and run CANN's set_env.sh; or use hal=ascend-sim "
                           f"(or {detect.SIM_ENV}=1) to simulate on the CPU") from exc
    return torch_npu


class AscendHal(Hal):
    name = "ascend"
    device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = detect.VISIBLE_DEVICES_ENV
    is_simulated = False

    def __init__(self, device_index: int | None = None, attention_backend: str = "auto") -> None:
        super().__init__(device_index, attention_backend)
        self._ops: AscendOps | None = None
        self._pool: Any = None
        self._logged: set[tuple[Any, ...]] = set()

    @classmethod
    def is_available(cls) -> bool:
        return detect.env_flag(detect.SIM_ENV) or detect.npu_present()

    @classmethod
    def substitute(cls) -> str | None:
        return "ascend-sim" if detect.env_flag(detect.SIM_ENV) else None

    @property
    def ops(self) -> AscendOps:
        """The torch_npu call sites bound to torch_npu (imported on first use)."""
        if self._ops is None:
            self._npu()
        return self._ops

    def _npu(self) -> Any:
        """`torch.npu`, which exists once torch_npu is imported: here, on first device use."""
        if self._ops is None:
            self._ops = AscendOps(_import_torch_npu())
        return torch.npu

    @property
    def fused_head_dims(self) -> tuple[int, ...] | None:
        return FUSED_HEAD_DIMS

    @property
    def fused_block_multiple(self) -> int:
        """Page sizes the fused op takes are multiples of this (up to 512)."""
        return BLOCK_SIZE

    @property
    def caps(self) -> Caps:
        npu, index = self._npu(), self.device().index
        props = npu.get_device_properties(index)
        return Caps(arch=npu.get_device_name(index), warp_size=None,
                    num_compute_units=int(getattr(props, "cube_core_num", 1) or 1), graphs=True,
                    graph_needs_host_update=True, uva=False, attention_backends=BACKENDS,
                    kv_block_sizes=(BLOCK_SIZE,), head_dims=self.fused_head_dims, fp8_dtype=None,
                    kv_quant_dtypes=KV_QUANT_DTYPES, dtypes=(torch.float32, torch.bfloat16, torch.float16))

    def versions(self) -> dict[str, str]:
        torch_npu = self.ops.lib
        out = {"torch_npu": str(torch_npu.__version__), "cann_toolkit": detect.cann_version_from_files()}
        for module in ("CANN", "DRIVER"):
            try:
                out[module.lower()] = str(torch_npu.npu.utils.get_cann_version(module))
            except Exception as exc:                   # old torch_npu or no driver: report, do not fail
                out[module.lower()] = f"unknown ({type(exc).__name__})"
        out["soc"] = self._npu().get_device_name(self.device().index)
        return out

    # ----- device and streams -----------------------------------------------------------------
    def device(self, index: int | None = None) -> torch.device:
        self._npu()                                   # torch knows the "npu" device type from here on
        return super().device(index)

    def device_count(self) -> int:
        return self._npu().device_count()

    def set_device(self, index: int) -> None:
        self.device_index = index
        self._npu().set_device(index)

    def stream(self, priority: int = 0) -> Any:
        return self._npu().Stream(device=self.device(), priority=priority)

    def current_stream(self) -> Any:
        return self._npu().current_stream(self.device())

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        with self._npu().stream(stream):
            yield

    def event(self, enable_timing: bool = False) -> Any:
        return self._npu().Event(enable_timing=enable_timing)

    def synchronize(self) -> None:
        self._npu().synchronize(self.device())

    # ----- memory -----------------------------------------------------------------------------
    def mem_info(self) -> MemInfo:
        free, total = self._npu().mem_get_info(self.device())
        return MemInfo(int(free), int(total))

    def memory_stats(self) -> dict[str, int]:
        npu, dev = self._npu(), self.device()
        return {"allocated": npu.memory_allocated(dev), "reserved": npu.memory_reserved(dev),
                "peak_allocated": npu.max_memory_allocated(dev)}

    def reset_peak_memory(self) -> None:
        self._npu().reset_peak_memory_stats(self.device())

    def empty_cache(self) -> None:
        self._npu().empty_cache()

    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> StagedHostBuffer:
        return StagedHostBuffer(shape, dtype, self.device(), pin=True)      # device() loads torch_npu

    # ----- graphs -----------------------------------------------------------------------------
    def graph_pool(self) -> Any:
        if self._pool is None:
            self._pool = self._npu().graph_pool_handle()
        return self._pool

    def graph(self) -> NpuGraph:
        return NpuGraph(self.ops, self.graph_pool())

    # ----- attention and fused ops ------------------------------------------------------------
    def fused_rejects(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                      block_size: int) -> list[str]:
        """Why the fused TND path cannot take this shape (empty: it can)."""
        reasons = []
        dims = self.fused_head_dims
        if dims is not None and head_dim not in dims:
            reasons.append(f"head dim {head_dim} (the TND path takes {', '.join(map(str, dims))})")
        if dims is not None and dtype not in FUSED_DTYPES:
            reasons.append(f"dtype {dtype} (the fused op takes float16/bfloat16)")
        if block_size % self.fused_block_multiple or block_size > 512:
            reasons.append(f"block size {block_size} (page attention takes multiples of "
                           f"{self.fused_block_multiple} up to 512)")
        if num_heads // num_kv_heads > 64:
            reasons.append(f"GQA ratio {num_heads // num_kv_heads} (at most 64)")
        return reasons

    def attention(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  block_size: int | None = None, backend: str | None = None,
                  kv_dtype: torch.dtype | None = None) -> AttentionBackend:
        """`kv_dtype=torch.int8` quantizes the KV cache (hal/ascend/quant_attention.py; the 910B has no
        FP8); every backend here keeps hal/common/kv_quant.py's `QuantLayout`."""
        requested = backend or self.attention_backend_name
        if requested not in ("auto", *BACKENDS):
            raise ValueError(f"unknown Ascend attention backend {requested!r}; choose auto or one of "
                             f"{BACKENDS}")
        if kv_dtype not in (None, dtype, *KV_QUANT_DTYPES):
            raise ValueError(f"kv_dtype {kv_dtype}: Ascend 910B attention reads 8-bit KV as int8 (no FP8 in "
                             f"the hardware); use kv_dtype=int8")
        is_int8 = kv_dtype == torch.int8
        block_size = block_size or BLOCK_SIZE
        rejects = self.fused_rejects(num_heads, num_kv_heads, head_dim, dtype, block_size)
        shape = f"H={num_heads} KVH={num_kv_heads} D={head_dim} {dtype} block {block_size}"
        if requested in ("fia", "fia_pa") and rejects:
            raise ValueError(f"attention backend {requested!r} cannot take {shape}: {'; '.join(rejects)}. "
                             f"Use attention_backend=auto (falls back to 'torch') or torch")
        if requested == "torch" or (requested == "auto" and rejects):
            reason = ("requested" if requested == "torch" else "fallback: " + "; ".join(rejects)) + \
                ", reference paged attention in plain torch on the device (no graphs)"
            chosen: AttentionBackend = FallbackAttention(num_heads, num_kv_heads, head_dim, dtype,
                                                         self.device(), block_size, reason=reason,
                                                         kv_dtype=kv_dtype if is_int8 else None)
        elif is_int8:
            from hal.ascend.quant_attention import Int8FusedAttention

            reason = (f"int8 KV, block {block_size}: npu_fused_infer_attention_score with antiquant mode 5 "
                      f"for decode and, a row per query, for passes that read less that way; other prefills "
                      f"over blocks dequantized to {dtype} (TND, sparse_mode 3)")
            chosen = Int8FusedAttention(num_heads, num_kv_heads, head_dim, dtype, self.device(), block_size,
                                        self.ops, reason=reason)
        else:
            reason = f"npu_fused_infer_attention_score TND, block {block_size}, sparse_mode 3" + \
                (" + _npu_paged_attention for decode-only steps" if requested == "fia_pa" else "")
            chosen = FusedAttention(num_heads, num_kv_heads, head_dim, dtype, self.device(), block_size,
                                    self.ops, paged_decode=requested == "fia_pa", reason=reason)
        if (shape, chosen.name) not in self._logged:
            self._logged.add((shape, chosen.name))
            log.info("ascend attention for %s: %s (%s)", shape, chosen.name, reason)
        return chosen

    def op(self, name: str) -> Callable[..., Any] | None:
        return make_op(name, self.ops)
