"""The conformance checks. Each takes a Hal and raises AssertionError (or SkipCheck) on its own;
it may return a short note for the report. Each belongs to an acceptance level (`report.py`).

The attention checks (paged attention, KV round trip, dense attention) are in `attention_checks.py`;
this module has the rest, lists every check in `CHECKS` and runs them (`run_all`).
"""
from __future__ import annotations

import os
import tempfile
import traceback
from typing import Callable, NamedTuple

import torch

from hal.base import Hal
from hal.conformance.attention_checks import (_max_err, check_dense_attention, check_kv_round_trip,
                                              check_paged_attention)


class SkipCheck(Exception):
    pass


class CheckResult(NamedTuple):
    name: str
    status: str        # PASS | FAIL | SKIP
    detail: str


def check_detect(hal: Hal) -> str:
    """The Hal's class detects the hardware, its device runs a kernel, and its caps are sane."""
    assert type(hal).is_available(), f"{type(hal).__name__}.is_available() is False on the device it runs on"
    assert hal.device_count() >= 1, f"device_count() = {hal.device_count()}"
    device = hal.device()
    assert device.type == hal.device_type, f"device() is {device}, device_type is {hal.device_type!r}"
    caps = hal.caps
    assert caps.arch and caps.num_compute_units >= 1, f"caps {caps}"
    assert caps.attention_backends and caps.kv_block_sizes and min(caps.kv_block_sizes) > 0, f"caps {caps}"
    assert caps.warp_size in (None, 32, 64), f"warp size {caps.warp_size}"
    x = torch.randn(1000)
    assert torch.equal((x.to(device) * 2).cpu(), x * 2), "a trivial kernel gave a wrong result"
    return f"arch={caps.arch} units={caps.num_compute_units} attention={','.join(caps.attention_backends)}"


def check_host_buffer(hal: Hal) -> None:
    """Rows written on the host are visible in the device view after `mark_dirty`, at a fixed address."""
    buf = hal.host_buffer((4, 32), torch.int32)
    view = buf.device_view()
    address = view.data_ptr()
    for step in range(3):
        values = torch.randint(-1000, 1000, (4, 32), dtype=torch.int32)
        buf.host.copy_(values)
        buf.mark_dirty(0, 4)
        view = buf.device_view()
        hal.synchronize()
        assert view.device.type == hal.device().type, f"device view on {view.device}"
        assert torch.equal(view.cpu(), values), f"step {step}: device view does not show the host rows"
        assert view.data_ptr() == address, "device view moved: graphs could not capture it"


def check_graph_replay(hal: Hal) -> None:
    """A captured graph replays the same work on new contents of its static inputs."""
    device = hal.device()
    x = torch.randn(16, 32, device=device)
    w = torch.randn(32, 8, device=device)
    graph = hal.graph()
    torch.relu(x @ w) + 1                 # warm-up outside capture (vendors need it for lazy init)
    out = graph.capture(lambda: torch.relu(x @ w) + 1)
    # a device graph records without running: outputs are defined once it has replayed
    for _ in range(3):
        x.copy_(torch.randn(16, 32, device=device))
        graph.update([])
        graph.replay()
        hal.synchronize()
        assert _max_err(out, torch.relu(x @ w) + 1) < 1e-4, "replay output differs from eager on new inputs"


def check_streams_events(hal: Hal) -> None:
    """Work on a side stream is ordered by events; timing events measure something non-negative."""
    device = hal.device()
    side = hal.stream()
    start, done = hal.event(enable_timing=True), hal.event(enable_timing=True)
    x = torch.randn(256, 256, device=device)
    start.record()
    side.wait_stream(hal.current_stream())   # x is written on the current stream
    with hal.use_stream(side):
        y = x @ x
        done.record()
    done.synchronize()
    assert _max_err(y, x @ x) < 1e-3
    assert start.elapsed_time(done) >= 0


def check_memory(hal: Hal) -> None:
    """mem_info and memory_stats answer with sane numbers."""
    info = hal.mem_info()
    assert 0 <= info.free_bytes <= info.total_bytes and info.total_bytes > 0, f"mem_info {info}"
    stats = hal.memory_stats()
    assert {"allocated", "reserved", "peak_allocated"} <= set(stats), f"memory_stats keys {sorted(stats)}"


def check_comm_one_rank(hal: Hal) -> None:
    """Every collective on a 1-rank process group of the Hal's backend gives the identity."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise SkipCheck("a process group is already initialised")
    device = hal.device()
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        kwargs = {"device_id": device} if device.type != "cpu" else {}
        dist.init_process_group(hal.dist_backend, store=store, rank=0, world_size=1, **kwargs)
        try:
            comm = hal.comm()
            assert (comm.rank, comm.world_size) == (0, 1)
            x = torch.randn(8, device=device)
            assert torch.equal(comm.all_reduce(x.clone()), x)
            out = torch.empty(8, device=device)
            assert torch.equal(comm.all_gather(out, x), x)
            assert torch.equal(comm.reduce_scatter(torch.empty(8, device=device), x.clone()), x)
            assert torch.equal(comm.broadcast(x.clone(), src=0), x)
            comm.barrier()
        finally:
            dist.destroy_process_group()


def check_fused_ops(hal: Hal) -> str:
    """The fused ops a Hal offers equal their torch expressions (`ops.py`)."""
    from hal.conformance.ops import check_fused_ops as run

    return run(hal)


def check_quantized_kv(hal: Hal) -> str:
    """An 8-bit KV cache in each format the Hal declares (`quant.py`)."""
    from hal.conformance.quant import check_quantized_kv as run

    return run(hal)


def check_fp8_linear(hal: Hal) -> str:
    """The FP8-weight linear op, where the Hal offers one (`quant.py`)."""
    from hal.conformance.quant import check_fp8_linear as run

    return run(hal)


CHECKS: dict[str, Callable[[Hal], str | None]] = {
    "detect": check_detect,
    "paged_attention": check_paged_attention,
    "kv_round_trip": check_kv_round_trip,
    "dense_attention": check_dense_attention,
    "host_buffer": check_host_buffer,
    "graph_replay": check_graph_replay,
    "streams_events": check_streams_events,
    "memory": check_memory,
    "comm_one_rank": check_comm_one_rank,
    "fused_ops": check_fused_ops,
    "quantized_kv": check_quantized_kv,
    "fp8_linear": check_fp8_linear,
}
# checks that need more than the Hal (the golden cases through an inference engine) come from the
# packages above it: `engine_checks()` loads them, or a caller passes them to `run_all`
ENGINE_CHECKS_GROUP = "loopstack.conformance"


def engine_checks() -> dict[str, Callable[[Hal], str | None]]:
    """Checks registered under the entry-point group `loopstack.conformance` (loopstack's runtime
    registers `golden_greedy`, level R3); empty where the package is not installed."""
    from importlib.metadata import entry_points

    return {ep.name: ep.load() for ep in entry_points(group=ENGINE_CHECKS_GROUP)}


def run_all(hal: Hal, only: list[str] | None = None,
            checks: dict[str, Callable[[Hal], str | None]] | None = None) -> list[CheckResult]:
    """Run `checks` (default: `CHECKS`) on `hal`; every failure is reported, none stops the rest."""
    results = []
    for name, check in (CHECKS if checks is None else checks).items():
        if only and name not in only:
            continue
        torch.manual_seed(0)
        try:
            note = check(hal)
            results.append(CheckResult(name, "PASS", note or ""))
        except SkipCheck as exc:
            results.append(CheckResult(name, "SKIP", str(exc)))
        except Exception as exc:  # report every failure, keep going
            detail = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, AssertionError):
                detail += "\n" + traceback.format_exc(limit=3)
            results.append(CheckResult(name, "FAIL", detail))
    return results
