"""The CUDA Hal on a real NVIDIA GPU (skipped elsewhere): caps, the mapping probe, zero-copy host
buffers (also read from inside a graph), the staged fallback, and graphs sharing one pool.
The vendor-neutral checks run on this Hal through tests/hal/test_conformance.py."""
import gc
import subprocess
import sys

import pytest
import torch

import hal
from hal.cuda import host_buffer as buffers
from hal.cuda.driver import cuda_host_device_pointer, cuda_pointer_kind
from helpers import ROOT

pytestmark = pytest.mark.cuda


@pytest.fixture
def cuda(monkeypatch):
    monkeypatch.delenv(buffers.UVA_ENV, raising=False)
    return hal.get("cuda")


def test_caps_describe_the_device(cuda):
    caps, props = cuda.caps, torch.cuda.get_device_properties(0)
    assert caps.arch == f"sm_{props.major}{props.minor}" and caps.warp_size == 32
    assert caps.num_compute_units == props.multi_processor_count and caps.graphs
    assert caps.fp8_dtype == (torch.float8_e4m3fn if (props.major, props.minor) >= (8, 9) else None)
    assert caps.uva, f"the mapping probe failed on an NVIDIA GPU: {cuda.uva().reason}"
    info = cuda.mem_info()
    assert 0 < info.free_bytes <= info.total_bytes and abs(info.total_bytes / props.total_memory - 1) < 0.05


def test_host_buffer_is_zero_copy(cuda):
    assert cuda.uva().is_mapped, cuda.uva().reason                       # the probe runs here, not below
    allocated = torch.cuda.memory_allocated()
    buf = cuda.host_buffer((64, 8), torch.int32)
    view = buf.device_view()
    assert isinstance(buf, buffers.MappedHostBuffer) and view.is_cuda and view.shape == (64, 8)
    assert torch.cuda.memory_allocated() == allocated, "the device view allocated device memory"
    assert view.data_ptr() == cuda_host_device_pointer(buf.host.data_ptr())
    assert cuda_pointer_kind(view.data_ptr()) in ("host", None)           # None: no cuda-python to ask
    for _ in range(3):                                                    # no mark_dirty, no copy
        values = torch.randint(-1 << 30, 1 << 30, (64, 8), dtype=torch.int32)
        buf.host.copy_(values)
        assert torch.equal((view * 1).cpu(), values)
    view.fill_(7)                                                         # device writes land on the host
    torch.cuda.synchronize()
    assert bool((buf.host == 7).all())


def test_device_view_keeps_the_host_memory_alive(cuda):
    view = cuda.host_buffer((1024,), torch.float32).device_view()
    view.fill_(3.5)
    gc.collect()
    # were the pinned block freed, the host allocator would hand it out again here
    others = [torch.randn(1024).pin_memory() for _ in range(4)]
    torch.cuda.synchronize()
    assert bool((view == 3.5).all()) and len(others) == 4


def test_graph_reads_host_buffer_without_copies(cuda):
    buf = cuda.host_buffer((32,), torch.int64)
    view = buf.device_view()
    buf.host.copy_(torch.randint(0, 1000, (32,)))
    (view * 2 + 1).sum()                                                  # warm-up outside capture
    graph = cuda.graph()
    out = graph.capture(lambda: view * 2 + 1)
    for _ in range(3):
        values = torch.randint(0, 1000, (32,))
        buf.host.copy_(values)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), values * 2 + 1)


def test_staged_fallback_when_forced(monkeypatch):
    monkeypatch.setenv(buffers.UVA_ENV, "0")
    cuda = hal.get("cuda")
    assert not cuda.caps.uva and "forced" in cuda.uva().reason
    buf = cuda.host_buffer((6, 4), torch.int32)
    assert isinstance(buf, buffers.StagedHostBuffer)
    first = torch.randint(1, 1 << 20, (6, 4), dtype=torch.int32)
    buf.host.copy_(first)
    buf.mark_dirty()
    view = buf.device_view()
    torch.cuda.synchronize()
    second = torch.randint(1, 1 << 20, (6, 4), dtype=torch.int32)
    buf.host.copy_(second)
    buf.mark_dirty(2, 5)
    assert buf.device_view().data_ptr() == view.data_ptr()
    torch.cuda.synchronize()
    expected = torch.cat([first[:2], second[2:5], first[5:]])
    assert torch.equal(view.cpu(), expected)


def test_graphs_capture_on_one_stream_and_replay(cuda):
    x, w = torch.randn(64, 128, device="cuda"), torch.randn(128, 32, device="cuda")
    first, second = cuda.graph(), cuda.graph()
    assert first.stream is second.stream
    torch.relu(x @ w)                                                     # warm-up (cuBLAS) outside capture
    y1 = first.capture(lambda: torch.relu(x @ w))
    y2 = second.capture(lambda: x.sum(dim=1) * 3)
    for _ in range(2):
        x.copy_(torch.randn(64, 128, device="cuda"))
        first.replay()
        torch.testing.assert_close(y1, torch.relu(x @ w))
        second.replay()
        torch.testing.assert_close(y2, x.sum(dim=1) * 3)
    with pytest.raises(RuntimeError, match="already captured"):
        first.capture(lambda: x + 1)


def test_triton_attention_is_chosen_when_the_kernels_are_there(cuda):
    from hal.cuda.attention import triton_status

    if not triton_status()[0]:
        pytest.skip(f"Triton backend unavailable here: {triton_status()[1]}")
    backend = cuda.attention(16, 8, 128, torch.bfloat16)
    assert backend.name == "triton" and cuda.caps.attention_backends[0] == "triton"
    assert cuda.kernel_configs()                                          # configs for this arch exist


def test_conformance_cli_reaches_r3():
    """`runtime.conformance` passes the engine's R3 check in (a checkout need not be installed)."""
    proc = subprocess.run([sys.executable, "-m", "runtime.conformance", "hal=cuda"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "acceptance level: R3" in proc.stdout and "cuda=" in proc.stdout


def test_captured_graph_keeps_its_inputs_alive(cuda):
    """A graph reads the tensors its function closes over at fixed addresses: they must outlive the
    code that made them (a freed static input was reused by the allocator: replays read garbage)."""
    def make():
        table = torch.randn(512, 64, device="cuda")
        ids = torch.zeros(8, dtype=torch.long, device="cuda")
        rows = torch.arange(8, device="cuda")                      # only the closure holds it
        fn = lambda: torch.nn.functional.embedding(ids, table).index_select(0, rows) * 2   # noqa: E731
        fn()
        graph = cuda.graph()
        return graph, graph.capture(fn), ids, table

    graph, out, ids, table = make()
    for step in range(5):
        junk = [torch.full((8,), 10**6, dtype=torch.long, device="cuda") for _ in range(64)]   # reuse bait
        ids.copy_(torch.randint(0, 512, (8,)))
        graph.replay()
        torch.testing.assert_close(out, table[ids] * 2)
        del junk
