"""Ascend graphs with per-replay host-parameter updates, and the staged host buffer.

Fused attention on Ascend takes sequence lengths as host lists, which a captured graph bakes in.
`AscendGraph.update(host_params)` replaces them before a replay: one dict per updatable call
captured, in capture order, keyed by that call's `update_keys` (`ops.CALL_SITES`); the attention
backend's `update_meta(meta, batch)` returns that list for the calls captured with `meta`. The list
is checked against what was captured (count, keys, batch sizes) on the NPU and in the simulation
alike; the simulation also refuses a replay that no update preceded.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from hal.ascend.ops import CALL_SITES, AscendOps, GraphCall
from hal.common.graph import copy_into, cycle_collector_paused


def check_host_params(calls: Sequence[GraphCall], host_params: Sequence[dict[str, Any]]) -> None:
    """Raise ValueError unless `host_params` fits the captured `calls` one to one."""
    if len(host_params) != len(calls):
        raise ValueError(f"graph update got {len(host_params)} host-param dicts; the graph captured "
                         f"{len(calls)} updatable calls (one dict per call, in capture order: what "
                         f"backend.update_meta(meta, batch) returns for the meta captured in this graph)")
    for i, (call, params) in enumerate(zip(calls, host_params)):
        if set(params) != set(call.host_params):
            raise ValueError(f"graph update entry {i} ({call.site}, plane {call.plane}) has keys "
                             f"{sorted(params)}, expected {sorted(call.host_params)}")
        for key, value in params.items():
            captured = call.host_params[key]
            if len(value) != len(captured):
                raise ValueError(f"graph update entry {i} ({call.site}): {key} has {len(value)} entries, the "
                                 f"graph was captured with {len(captured)} (batch sizes are fixed per graph)")
            is_host_tensor = isinstance(value, torch.Tensor) and value.device.type == "cpu"
            if isinstance(captured, torch.Tensor) and not (is_host_tensor and value.dtype == captured.dtype):
                raise ValueError(f"graph update entry {i}: {key} must be a host {captured.dtype} tensor")


class AscendGraph:
    """The `hal.resources.Graph` protocol over the NPU or the simulation (subclasses do the device part)."""

    def __init__(self, ops: AscendOps) -> None:
        self.ops = ops
        self.calls: list[GraphCall] = []        # updatable calls, in capture order

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Capture `fn()`; its outputs hold valid values on return and are overwritten by replays."""
        if self.ops.capture_log is not None:
            raise RuntimeError("another Ascend graph is capturing")
        self.ops.capture_log = []
        try:
            with cycle_collector_paused():
                out = self._capture(fn)
        finally:
            self.calls, self.ops.capture_log = self.ops.capture_log, None
        self.fn = fn          # keeps every tensor the captured work reads (fn's closure) allocated
        return out

    def update(self, host_params: Sequence[dict[str, Any]]) -> None:
        check_host_params(self.calls, host_params)
        self._update([dict(p) for p in host_params])

    def replay(self) -> None:
        self._replay()

    def _capture(self, fn: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def _update(self, host_params: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def _replay(self) -> None:
        raise NotImplementedError


class NpuGraph(AscendGraph):
    """`torch.npu.NPUGraph` captured with `auto_dispatch_capture=True`, so torch_npu records the
    updatable ops and `NPUGraph.update(cpu_update_input=...)` can re-issue them with new lengths."""

    def __init__(self, ops: AscendOps, pool: Any) -> None:
        super().__init__(ops)
        self.pool = pool
        self.graph = torch.npu.NPUGraph()

    def _capture(self, fn: Callable[[], Any]) -> Any:
        with torch.npu.graph(self.graph, pool=self.pool, auto_dispatch_capture=True):
            out = fn()
        self.graph.replay()              # capture records work without running it: fill the outputs
        return out

    def _update(self, host_params: list[dict[str, Any]]) -> None:
        if host_params:
            # the update re-issues the recorded tasks; a previous replay still queued would see the
            # new lengths (vllm-ascend synchronizes here for the same reason)
            torch.npu.current_stream().synchronize()
            self.graph.update(cpu_update_input=host_params)

    def _replay(self) -> None:
        self.graph.replay()


class SimGraph(AscendGraph):
    """Eager replay on the CPU with the NPU's update contract (see `hal.ascend.sim.npu`)."""

    def __init__(self, ops: AscendOps) -> None:
        super().__init__(ops)
        self.fn: Callable[[], Any] | None = None
        self.outputs: Any = None
        self.records: list = []
        self.is_updated = False

    def _capture(self, fn: Callable[[], Any]) -> Any:
        self.records = []
        with self.ops.lib.capturing(self.records):
            self.outputs = fn()
        logged = [CALL_SITES[call.site].op for call in self.ops.capture_log]
        if logged != [record.op for record in self.records]:
            raise RuntimeError(f"the backends logged updatable calls {logged} but the ops recorded "
                               f"{[r.op for r in self.records]}: update_meta's host params would not line up")
        self.fn, self.is_updated = fn, False
        return self.outputs

    def _update(self, host_params: list[dict[str, Any]]) -> None:
        from hal.ascend.sim.npu import SimRecord

        # what NPUGraph.update does: replace the keys each record was captured with
        self.records[:] = [SimRecord(r.op, {k: p.get(k, v) for k, v in r.host_args.items()})
                           for r, p in zip(self.records, host_params)]
        self.is_updated = True

    def _replay(self) -> None:
        from hal.ascend.sim.npu import GraphReplayError

        if self.fn is None:
            raise RuntimeError("replay before capture")
        if self.records and not self.is_updated:
            raise GraphReplayError(f"replay without update: this graph bakes the host lengths of "
                                   f"{len(self.records)} attention calls; call "
                                   f"graph.update(backend.update_meta(meta, batch)) first")
        with self.ops.lib.replaying(self.records):
            copy_into(self.outputs, self.fn())
        self.is_updated = False
