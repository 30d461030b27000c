"""CPU Hal: streams, events and graphs as correct no-ops or eager replays; comm over gloo."""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from hal.attention import AttentionBackend
from hal.base import Caps, Hal
from hal.common.graph import EagerGraph
from hal.common.host import CpuHostBuffer, HostDevice
from hal.common.torch_attention import TorchPagedAttention

log = logging.getLogger(__name__)


class CpuHal(HostDevice, Hal):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = None

    @classmethod
    def is_available(cls) -> bool:
        return True

    def __init__(self, device_index: int | None = None, attention_backend: str = "auto") -> None:
        if attention_backend not in ("auto", "torch"):      # at construction: a misspelling fails at start
            raise ValueError(f"hal cpu has no attention backend {attention_backend!r}; choose one of auto, torch")
        super().__init__(device_index, attention_backend)

    @property
    def caps(self) -> Caps:
        return Caps(arch="cpu", warp_size=None, num_compute_units=torch.get_num_threads(), graphs=False,
                    graph_needs_host_update=False, uva=True, attention_backends=("torch",),
                    kv_block_sizes=(16,), head_dims=None, fp8_dtype=torch.float8_e4m3fn,
                    kv_quant_dtypes=(torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.int8))

    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> CpuHostBuffer:
        return CpuHostBuffer(shape, dtype)

    def graph(self) -> EagerGraph:
        return EagerGraph()

    def attention(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                  block_size: int | None = None, backend: str | None = None,
                  kv_dtype: torch.dtype | None = None) -> AttentionBackend:
        requested = backend or self.attention_backend_name
        if requested not in ("auto", "torch"):
            raise ValueError(f"the CPU Hal has attention backend 'torch' only, not {requested!r}")
        return TorchPagedAttention(num_heads, num_kv_heads, head_dim, dtype, self.device(),
                                   block_size or self.caps.kv_block_sizes[0], kv_dtype=kv_dtype)
