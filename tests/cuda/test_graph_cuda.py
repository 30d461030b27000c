"""On an NVIDIA GPU: a capture survives a cycle collection that frees a dead cycle holding other
graphs and their memory (an engine dropped while its runner sat in a reference cycle). The collector
is paused inside captures (hal/common/graph.py `cycle_collector_paused`); without the pause a
collection there may run inside the capture."""
import gc

import pytest
import torch

import hal

pytestmark = pytest.mark.cuda


class _Cycle:
    def __init__(self) -> None:
        self.me = self                 # only the cycle collector frees it
        self.kept: list = []


def _dead_cycle_of_graphs(gpu, num_graphs: int) -> None:
    holder = _Cycle()
    for _ in range(num_graphs):
        x = torch.randn(256, 256, device="cuda")
        graph = gpu.graph()
        fn = lambda x=x: x @ x       # noqa: E731
        fn()                          # warm-up outside capture
        holder.kept.append((graph, graph.capture(fn)))
    torch.cuda.synchronize()


def test_a_capture_survives_a_collection_of_dead_graphs():
    gpu = hal.get("cuda")
    a = torch.randn(512, 512, device="cuda")
    thresholds = gc.get_threshold()

    def fn():
        gc.set_threshold(1, 1, 1)     # every allocation collects every generation, unless paused
        try:
            junk = [{"row": i} for i in range(2000)]
            b = a @ a
            return b @ a, len(junk)
        finally:
            gc.set_threshold(*thresholds)

    fn()
    torch.cuda.synchronize()
    gc.collect()
    _dead_cycle_of_graphs(gpu, 12)
    assert any(type(o) is _Cycle for o in gc.get_objects())
    graph = gpu.graph()
    out, _ = graph.capture(fn)
    a.copy_(torch.randn(512, 512, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, (a @ a) @ a, rtol=1e-3, atol=1e-2)
    gc.collect()
    assert not any(type(o) is _Cycle for o in gc.get_objects())
