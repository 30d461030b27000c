"""The AMD Hal: a ROCm build of torch presents HIP as torch "cuda", so streams, events, hipGraph
(through torch.cuda.CUDAGraph), RCCL (the "nccl" backend) and the host-buffer machinery are the
CUDA Hal's. What differs is decided here from the gfx arch: wave size, FP8 flavour, the Triton
kernel configs, and the attention backends (Triton, then torch; FlashAttention is NVIDIA-only).
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch

from hal.attention import AttentionBackend
from hal.cuda.hal import CudaHal, DeviceFacts, fresh_prefill_choice
from hal.rocm.driver import hip_host_device_pointer
from hal.rocm.visible import sync_visible_devices

FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")      # MI300: FP8 with NaN at -0, no infinities


def gfx_arch(props: Any) -> str:
    """The arch from gcnArchName: "gfx942:sramecc+:xnack-" -> "gfx942" (the target features after
    ':' change none of our choices)."""
    full = getattr(props, "gcnArchName", None)
    if not full:
        raise RuntimeError("torch.cuda.get_device_properties() has no gcnArchName; the ROCm Hal needs a ROCm "
                           "build of torch (pip install torch --index-url https://download.pytorch.org/whl/rocm6.4)")
    return str(full).split(":", 1)[0].strip()


def is_wave64_arch(arch: str) -> bool:
    """GCN and CDNA (gfx9xx: MI100 .. MI350) run 64-wide waves; RDNA (gfx10xx-12xx) runs 32 by default."""
    return re.fullmatch(r"gfx9[0-9a-f]{2}", arch) is not None


def fp8_dtype_for(arch: str) -> torch.dtype | None:
    """FNUZ e4m3 on MI300 (gfx940-942), OCP e4m3fn on MI350 (gfx950) and RDNA4 (gfx12xx), else none."""
    if arch in FNUZ_ARCHS:
        return torch.float8_e4m3fnuz
    if arch == "gfx950" or arch.startswith("gfx12"):
        return torch.float8_e4m3fn
    return None


def rocm_facts(props: Any) -> DeviceFacts:
    arch = gfx_arch(props)
    reported = getattr(props, "warp_size", None)          # newer torch reports it; trust it when present
    by_arch = 64 if is_wave64_arch(arch) else 32
    warp = int(reported) if isinstance(reported, int) and reported > 0 else by_arch
    return DeviceFacts(arch, warp, int(props.multi_processor_count), fp8_dtype_for(arch),
                       (torch.float32, torch.bfloat16, torch.float16))


def is_flash_attention_name(name: str) -> bool:
    normalized = name.strip().lower().replace("-", "_")
    return normalized.startswith("flash") or re.fullmatch(r"fa\d?", normalized) is not None


def refuse_flash_attention(name: str | None) -> None:
    if name and is_flash_attention_name(name):
        raise ValueError(f"attention backend {name!r}: FlashAttention backends are NVIDIA-only here "
                         f"(hal=cuda). On ROCm use attention_backend=auto, triton or torch")


class RocmHal(CudaHal):
    name = "rocm"
    visible_devices_env = "HIP_VISIBLE_DEVICES"
    backend_order = ("triton", "torch")
    graph_collectives = False  # RCCL under hipGraph capture is unvalidated here: TP decode runs eagerly

    def __init__(self, device_index: int | None = None, attention_backend: str = "auto",
                 decode_projections: bool | None = None) -> None:
        refuse_flash_attention(attention_backend)
        sync_visible_devices(os.environ)
        super().__init__(device_index, attention_backend, decode_projections)

    @classmethod
    def is_available(cls) -> bool:
        """A ROCm build of torch (`torch.version.hip`) that sees a device. The visible-device
        variables are reconciled first (HIP reads them once, when it starts); the count comes from
        amdsmi or hipGetDeviceCount, which create no context; no properties are read."""
        if not getattr(torch.version, "hip", None):
            return False
        sync_visible_devices(os.environ)
        try:
            return torch.cuda.device_count() > 0
        except Exception:  # a broken runtime means "not available", never a crash in detect()
            return False

    def device_facts(self, props: Any) -> DeviceFacts:
        return rocm_facts(props)

    def host_device_pointer(self, host_ptr: int) -> int:
        """Device address of pinned host memory (hipHostGetDevicePointer through ctypes)."""
        return hip_host_device_pointer(host_ptr)

    def _table_linear(self) -> None:
        """F.linear's hipBLASLt choice: the measured table is cuBLASLt's (torch's TunableOp tunes
        hipBLASLt on ROCm, `PYTORCH_TUNABLEOP_ENABLED=1`)."""
        return None

    def fresh_prefill(self) -> str | None:
        """Prefill chunks without context: torch SDPA per sequence (its ROCm flash kernel), not the
        CUDA-only varlen entry point."""
        return None if fresh_prefill_choice() == "0" else "sdpa"

    def attention(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  block_size: int | None = None, backend: str | None = None,
                  kv_dtype: torch.dtype | None = None) -> AttentionBackend:
        refuse_flash_attention(backend or self.attention_backend_name)
        return super().attention(num_heads, num_kv_heads, head_dim, dtype, block_size, backend, kv_dtype)
