"""The engine loop without HTTP: admission is all-or-nothing, every request that leaves the engine
gets a final output and frees its blocks (finished, aborted, failed step, shutdown)."""
from __future__ import annotations

import asyncio
import time

import pytest

SERVE_EXTRA = "needs the serve extra: pip install -e '.[serve]'"
pytest.importorskip("prometheus_client", reason=SERVE_EXTRA)

from runtime import SamplingParams
from runtime.server.engine_loop import EngineLoop
from runtime.server.engine_messages import NewRequest, Overloaded, ShuttingDown

IDS = [50, 42, 53, 42, 52, 24]
GREEDY = dict(temperature=0.0, ignore_eos=True)


def request(request_id: str, max_tokens: int = 4, ids=IDS) -> NewRequest:
    return NewRequest(request_id, list(ids), SamplingParams(max_tokens=max_tokens, **GREEDY))


async def final_outputs(outputs: asyncio.Queue, num_requests: int) -> dict[int, object]:
    finals = {}
    while len(finals) < num_requests:
        index, out = await asyncio.wait_for(outputs.get(), timeout=60)
        if out.finished:
            finals[index] = out
    return finals


def assert_clean(engine, loop: EngineLoop) -> None:
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.has_unfinished_requests() and loop.num_in_flight == 0


def test_outputs_arrive_in_order_and_the_batch_matches_the_engine_alone(make_engine):
    expected = make_engine()
    for i, ids in enumerate([IDS, IDS[:3]]):
        expected.add_request(str(i), ids, SamplingParams(max_tokens=5, **GREEDY))
    expected = {int(o.request_id): o.token_ids for o in expected.run_until_done()}
    engine = make_engine()
    loop = EngineLoop(engine, max_num_requests=4)
    loop.start()

    async def run():
        outputs = await loop.add([request("a", 5), request("b", 5, IDS[:3])], time.monotonic())
        seen = {0: [], 1: []}
        finals = {}
        while len(finals) < 2:
            index, out = await outputs.get()
            seen[index].append(len(out.token_ids))
            if out.finished:
                finals[index] = out
        return seen, finals

    seen, finals = asyncio.run(run())
    assert seen == {0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4, 5]}           # one output per token, growing
    assert {i: o.token_ids for i, o in finals.items()} == expected
    assert all(o.finish_reason == "length" for o in finals.values())
    loop.shutdown()
    assert_clean(engine, loop)


def test_admission_is_all_or_nothing_and_capped(make_engine):
    engine = make_engine()
    loop = EngineLoop(engine, max_num_requests=2)
    loop.start()

    async def run():
        with pytest.raises(ValueError, match="out of range"):
            await loop.add([request("good"), request("bad", ids=[5, 10_000])], time.monotonic())
        assert loop.num_in_flight == 0 and not engine.requests          # the good one was withdrawn
        with pytest.raises(ValueError, match="split the batch"):     # more than ever fit: not "retry later"
            await loop.add([request(str(i)) for i in range(3)], time.monotonic())
        assert loop.num_in_flight == 0 and not engine.requests
        outputs = await loop.add([request("x", 200), request("y", 200)], time.monotonic())
        with pytest.raises(Overloaded):
            await loop.add([request("z")], time.monotonic())
        loop.abort("x")
        loop.abort("y", finish_reason="stop")
        return await final_outputs(outputs, 2)

    finals = asyncio.run(run())
    assert (finals[0].finish_reason, finals[1].finish_reason) == ("abort", "stop")
    assert loop.metrics.registry.get_sample_value("loopstack_requests_total", {"finish_reason": "abort"}) == 1
    loop.shutdown()
    assert_clean(engine, loop)


def fail_second_step(engine, monkeypatch) -> None:
    """The engine's second step raises "device lost"; the others run."""
    real_step = engine.step
    calls = []

    def flaky_step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real_step()
    monkeypatch.setattr(engine, "step", flaky_step)


def test_a_failing_step_fails_its_requests_and_the_loop_keeps_serving(make_engine, monkeypatch):
    engine = make_engine()
    loop = EngineLoop(engine)
    fail_second_step(engine, monkeypatch)
    loop.start()

    async def run():
        failed = await final_outputs(await loop.add([request("a", 8)], time.monotonic()), 1)
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
        ok = await final_outputs(await loop.add([request("b", 3)], time.monotonic()), 1)
        return failed[0], ok[0]

    failed, ok = asyncio.run(run())
    assert failed.finish_reason == "error" and "device lost" in failed.error
    assert ok.finish_reason == "length" and len(ok.token_ids) == 3
    loop.shutdown()
    assert_clean(engine, loop)


def test_a_failing_tensor_parallel_step_stops_the_loop(make_engine, monkeypatch):
    """With other ranks replaying the driver's steps, a failed step may leave them inside it or past
    it: the loop fails what it holds and stops taking requests instead of stepping on."""
    engine = make_engine()
    loop = EngineLoop(engine)
    fail_second_step(engine, monkeypatch)
    monkeypatch.setattr(type(engine), "is_tensor_parallel", property(lambda self: True))
    loop.start()

    async def run():
        failed = await final_outputs(await loop.add([request("a", 8)], time.monotonic()), 1)
        loop._thread.join(10)
        with pytest.raises(ShuttingDown):
            await loop.add([request("b", 3)], time.monotonic())
        return failed[0]

    failed = asyncio.run(run())
    assert failed.finish_reason == "error" and "device lost" in failed.error and "restart it" in failed.error
    assert not loop.is_alive and not loop.is_accepting and "tensor parallelism" in str(loop.error)
    assert_clean(engine, loop)


@pytest.mark.parametrize("drain_s,finish_reason", [(0.0, "abort"), (60.0, "length")])
def test_shutdown_drains_then_aborts(make_engine, drain_s, finish_reason):
    engine = make_engine()
    loop = EngineLoop(engine)
    loop.start()

    async def run():
        outputs = await loop.add([request("a", 30)], time.monotonic())
        await outputs.get()                                        # running
        await asyncio.to_thread(loop.shutdown, drain_timeout_s=drain_s)
        with pytest.raises(ShuttingDown):
            await loop.add([request("late")], time.monotonic())
        return await final_outputs(outputs, 1)

    final = asyncio.run(run())[0]
    assert final.finish_reason == finish_reason
    assert (len(final.token_ids) == 30) == (finish_reason == "length")
    assert not loop.is_alive
    assert_clean(engine, loop)


def test_the_pool_gauges_are_published_before_any_request(make_engine):
    from runtime.server.metrics import ServerMetrics

    engine, metrics = make_engine(), ServerMetrics()
    loop = EngineLoop(engine, metrics)
    loop.start()
    try:
        text = metrics.render().decode()
        blocks = engine.blocks.num_blocks
        assert blocks > 0
        assert f"loopstack_kv_blocks {float(blocks)}" in text
        assert f"loopstack_kv_blocks_free {float(blocks)}" in text
    finally:
        loop.shutdown()


def test_a_second_ctrl_c_ends_the_drain_at_once(monkeypatch):
    """uvicorn sets force_exit on a second SIGINT: the drain (30 s here) then ends within a poll, and
    the app's lifespan still shuts down (uvicorn skips it when forced, and the cancelled lifespan
    task printed a CancelledError traceback)."""
    import threading

    import uvicorn

    from runtime.server.http_server import GracefulServer

    class SlowToDrain:
        def __init__(self) -> None:
            self.drains: list[float] = []
            self.ended = threading.Event()

        def shutdown(self, drain_timeout_s: float = 0.0, join_timeout_s: float = 30.0) -> None:
            self.drains.append(drain_timeout_s)
            if drain_timeout_s == 0.0:
                self.ended.set()
            self.ended.wait(timeout=drain_timeout_s)

    async def stopped(self, sockets=None) -> None:
        pass

    monkeypatch.setattr(uvicorn.Server, "shutdown", stopped)
    engine_loop = SlowToDrain()
    server = GracefulServer(uvicorn.Config(lambda scope, receive, send: None), engine_loop, shutdown_timeout_s=30.0)
    lifespan_shutdowns = []

    class Lifespan:
        async def shutdown(self) -> None:
            lifespan_shutdowns.append(engine_loop.ended.is_set())

    server.lifespan = Lifespan()

    async def run() -> float:
        start = time.monotonic()
        shutting_down = asyncio.ensure_future(server.shutdown())
        await asyncio.sleep(0.3)
        server.force_exit = True
        await asyncio.wait_for(shutting_down, timeout=10)
        return time.monotonic() - start

    assert asyncio.run(run()) < 5
    assert engine_loop.drains == [30.0, 0.0]
    assert lifespan_shutdowns == [True]
