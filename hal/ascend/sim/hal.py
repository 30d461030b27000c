"""`SimAscendHal`: `hal=ascend-sim`, the Ascend Hal on the CPU. The Ascend attention backends, fused ops and graph update
contract run unchanged, with `hal.ascend.sim.npu.SimNpu` in place of torch_npu; streams and events are
the CPU's, graphs replay eagerly (`hal.ascend.graph.SimGraph`), collectives use gloo.

`sim_any_shape=True` (env `LOOPSTACK_ASCEND_SIM_ANY_SHAPE=1`) lifts the fused path's hardware limits
(head dim 128, fp16/bf16, pages of 128) so tiny float32 test models exercise it, also with pages of
16 tokens (many blocks per sequence); the default keeps them, so shapes go to the same backends
they would on a 910B.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from hal.ascend import detect
from hal.ascend.graph import SimGraph
from hal.ascend.hal import BACKENDS, BLOCK_SIZE, FUSED_HEAD_DIMS, KV_QUANT_DTYPES, AscendHal
from hal.ascend.ops import AscendOps
from hal.base import Caps
from hal.common.host import HostDevice
from hal.common.host_buffer import StagedHostBuffer

ANY_SHAPE_BLOCK_MULTIPLE = 16           # what the simulated op checks with the shape limits lifted


class SimAscendHal(HostDevice, AscendHal):
    """hal=ascend on the CPU: the Ascend code paths with `hal.ascend.sim.npu` in place of torch_npu."""

    name = "ascend-sim"
    device_type = "cpu"
    dist_backend = "gloo"
    is_simulated = True
    device_label = "simulated Ascend Hal"

    def __init__(self, device_index: int | None = None, attention_backend: str = "auto",
                 sim_any_shape: bool | None = None) -> None:
        super().__init__(device_index, attention_backend)
        from hal.ascend.sim.npu import SimNpu

        self.any_shape = detect.env_flag(detect.SIM_ANY_SHAPE_ENV) if sim_any_shape is None else sim_any_shape
        self._ops = AscendOps(SimNpu(strict=not self.any_shape))

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def substitute(cls) -> str | None:
        return None

    @property
    def fused_head_dims(self) -> tuple[int, ...] | None:
        return None if self.any_shape else FUSED_HEAD_DIMS

    @property
    def fused_block_multiple(self) -> int:
        return ANY_SHAPE_BLOCK_MULTIPLE if self.any_shape else BLOCK_SIZE

    @property
    def caps(self) -> Caps:
        block_sizes = (BLOCK_SIZE, ANY_SHAPE_BLOCK_MULTIPLE) if self.any_shape else (BLOCK_SIZE,)
        return Caps(arch="Ascend910B-sim" + ("-any-shape" if self.any_shape else ""), warp_size=None,
                    num_compute_units=torch.get_num_threads(), graphs=True, graph_needs_host_update=True,
                    uva=False, attention_backends=BACKENDS, kv_block_sizes=block_sizes,
                    head_dims=self.fused_head_dims, fp8_dtype=None, kv_quant_dtypes=KV_QUANT_DTYPES,
                    dtypes=(torch.float32, torch.bfloat16, torch.float16))

    def versions(self) -> dict[str, str]:
        return {"torch_npu": "not used: CPU simulation of the torch-npu 2.13.0 op schemas",
                "mode": "any-shape" if self.any_shape else "strict"}

    def host_buffer(self, shape: Sequence[int], dtype: torch.dtype) -> StagedHostBuffer:
        return StagedHostBuffer(shape, dtype, self.device(), pin=False)

    def graph_pool(self) -> Any:
        return None

    def graph(self) -> SimGraph:
        return SimGraph(self.ops)
