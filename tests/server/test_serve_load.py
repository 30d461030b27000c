"""The server under load and at the edges of a request's life: 200 concurrent requests all answered
with no KV block leaked, 429 with Retry-After past the cap, a client that leaves frees its request,
and shutdown either lets in-flight requests finish or aborts them cleanly."""
from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

SERVE_EXTRA = "needs the serve extra: pip install -e '.[serve]'"
httpx = pytest.importorskip("httpx", reason=SERVE_EXTRA)
pytest.importorskip("fastapi", reason=SERVE_EXTRA)

from live_server import wait_until
from runtime import LLM, SamplingParams
from runtime.server.app import build_app
from runtime.server.config import ServerConfig

PROMPTS = ["the cat sat on", "hello, how are you?", "loops make a small model"]
LONG = {"max_tokens": 240, "ignore_eos": True, "num_loops": 16, "temperature": 0}   # seconds, not ms


def completion(prompt=PROMPTS[0], **fields) -> dict:
    return {"model": "tiny", "prompt": prompt, "temperature": 0, **fields}


def sse_payloads(lines) -> list:
    """The JSON payloads of `data:` lines, and "[DONE]" as itself."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def count(app, finish_reason: str) -> float:
    labels = {"finish_reason": finish_reason}
    return app.state.metrics.registry.get_sample_value("loopstack_requests_total", labels) or 0.0


def assert_no_block_leaked(server) -> None:
    wait_until(lambda: server.loop.num_in_flight == 0, what="requests to leave the engine")
    wait_until(lambda: server.loop.state.num_free_blocks == server.loop.state.num_blocks,
               what="blocks to be freed")


def test_200_concurrent_requests_are_all_answered_and_leak_no_block(make_engine, tiny_model, tokenizer,
                                                                     live_server):
    llm = LLM(tiny_model, hal="cpu", tokenizer=tokenizer, num_kv_blocks=64)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))
    expected = {p: o.text for p, o in zip(PROMPTS, outputs)}
    engine = make_engine(max_num_seqs=32)
    app = build_app(engine, ServerConfig(model_name="tiny", max_num_requests=64, retry_after_s=2))
    server = live_server(app)

    async def one(client, semaphore, i):
        async with semaphore:
            body = completion(PROMPTS[i % 3], max_tokens=4, stream=i % 2 == 1)
            response = await client.post("/v1/completions", json=body)
            if response.status_code != 200:
                return i, response.status_code, response.headers.get("retry-after"), response.json()
            if body["stream"]:
                payloads = sse_payloads(response.text.splitlines())
                assert payloads[-1] == "[DONE]"
                return i, 200, None, "".join(p["choices"][0]["text"] for p in payloads[:-1])
            return i, 200, None, response.json()["choices"][0]["text"]

    async def fire(num_requests: int, max_in_flight: int):
        semaphore = asyncio.Semaphore(max_in_flight)
        limits = httpx.Limits(max_connections=max_in_flight)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            requests = (one(client, semaphore, i) for i in range(num_requests))
            return await asyncio.wait_for(asyncio.gather(*requests), timeout=300)

    results = asyncio.run(fire(200, 200))
    assert sorted(r[0] for r in results) == list(range(200)), "a request was lost"
    statuses = [r[1] for r in results]
    assert set(statuses) <= {200, 429}, statuses
    answered = [r for r in results if r[1] == 200]
    assert answered, "no request got through"
    for i, _, _, text in answered:
        assert text == expected[PROMPTS[i % 3]], f"request {i}"
    for _, _, retry_after, body in (r for r in results if r[1] == 429):
        assert retry_after == "2" and body["error"]["code"] == "server_overloaded"
    assert_no_block_leaked(server)
    server.stop()
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.has_unfinished_requests()
    assert count(app, "length") + count(app, "stop") == len(answered)
    print(f"200 concurrent requests: {len(answered)} answered 200, {statuses.count(429)} answered 429")


def test_overload_answers_429_with_retry_after(make_engine, live_server):
    openai = pytest.importorskip("openai")
    app = build_app(make_engine(), ServerConfig(model_name="tiny", max_num_requests=2, retry_after_s=3))
    server = live_server(app)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        busy_body = completion(PROMPTS[:2], stream=True, **LONG)
        with http.stream("POST", "/v1/completions", json=busy_body) as busy:
            lines = busy.iter_lines()            # kept: closing it would hang up the stream
            next(line for line in lines if line.startswith("data: "))                # both admitted
            assert server.loop.num_in_flight == 2
            refused = http.post("/v1/completions", json=completion(max_tokens=2))
            assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
            assert refused.json()["error"]["code"] == "server_overloaded"
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert_no_block_leaked(server)           # closing the stream aborted both
        assert http.post("/v1/completions", json=completion(max_tokens=2)).status_code == 200


def test_a_client_leaving_mid_stream_frees_its_request_and_blocks(make_engine, live_server):
    app = build_app(make_engine(), ServerConfig(model_name="tiny"))
    server = live_server(app)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=completion(stream=True, **LONG)) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                next(lines)
            assert server.loop.state.num_free_blocks < server.loop.state.num_blocks
        # the client hung up with ~237 tokens to go
        assert_no_block_leaked(server)
        assert count(app, "abort") == 1
        generated = app.state.metrics.registry.get_sample_value("loopstack_generation_tokens_total")
        assert generated < LONG["max_tokens"]

        # a plain (non-streamed) request whose client gives up is aborted too
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=completion(**LONG), timeout=httpx.Timeout(60, read=0.3))
        assert_no_block_leaked(server)
        assert count(app, "abort") == 2


def test_graceful_shutdown_lets_an_open_stream_finish(make_engine, live_server):
    engine = make_engine()
    app = build_app(engine, ServerConfig(model_name="tiny"))
    server = live_server(app, shutdown_timeout_s=60)
    body = completion(stream=True, stream_options={"include_usage": True},
                      **{**LONG, "max_tokens": 40, "num_loops": 8})
    with httpx.Client(base_url=server.url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            payloads = sse_payloads([next(line for line in lines if line.startswith("data: "))])
            stopper = threading.Thread(target=server.stop)
            stopper.start()
            # while in-flight requests drain, the server still listens: a new request gets 503 + Retry-After
            wait_until(lambda: not server.loop.is_accepting, what="the drain to start")
            with httpx.Client(base_url=server.url, timeout=60) as other:
                late = other.post("/v1/completions", json=completion(max_tokens=2))
                health = other.get("/health")
            assert late.status_code == 503 and late.headers["Retry-After"] == "1"
            assert late.json()["error"]["code"] == "shutting_down" and health.status_code == 503
            payloads += sse_payloads(lines)
    stopper.join(60)
    assert not _accepts_connections(server.port)
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["usage"]["completion_tokens"] == 40
    assert [p["choices"][0]["finish_reason"] for p in payloads[:-2]][-1] == "length"
    assert not server.loop.is_alive
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and count(app, "abort") == 0


def test_shutdown_aborts_what_outlives_the_grace_period(make_engine, live_server):
    engine = make_engine()
    app = build_app(engine, ServerConfig(model_name="tiny"))
    server = live_server(app, shutdown_timeout_s=0.3)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = completion(stream=True, stream_options={"include_usage": True}, **LONG)
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            payloads = sse_payloads([next(line for line in lines if line.startswith("data: "))])
            stopper = threading.Thread(target=server.stop)
            stopper.start()
            payloads += sse_payloads(lines)
    stopper.join(60)
    assert payloads[-1] == "[DONE]"                      # the stream ends properly, cut short:
    assert payloads[-2]["error"]["code"] == "shutting_down"            # an error object says why,
    streamed = sum(1 for p in payloads[:-4] if p["choices"][0]["text"])
    assert payloads[-3]["choices"] == [] and streamed <= payloads[-3]["usage"]["completion_tokens"]   # the usage,
    assert payloads[-4]["choices"][0]["finish_reason"] == "length"     # after an OpenAI finish_reason
    assert streamed < LONG["max_tokens"]
    assert not stopper.is_alive() and not server.loop.is_alive
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and not engine.has_unfinished_requests()
    assert count(app, "abort") == 1


def test_a_best_of_request_cut_off_at_shutdown_gets_503(make_engine, live_server):
    """Aborted before its best samples were chosen, a best_of > n request reports every sample; the
    server took the extra ones for choices that do not exist (500 IndexError)."""
    engine = make_engine()
    server = live_server(build_app(engine, ServerConfig(model_name="tiny")), shutdown_timeout_s=0.3)
    result = {}

    def send():
        with httpx.Client(base_url=server.url, timeout=60) as http:
            result["response"] = http.post("/v1/completions", json=completion(
                **{**LONG, "temperature": 1.0}, seed=0, n=1, best_of=3))

    sender = threading.Thread(target=send)
    sender.start()
    wait_until(lambda: server.loop.state.num_running > 0, what="the request to run")
    server.stop()
    sender.join(60)
    response = result["response"]
    assert response.status_code == 503 and response.json()["error"]["code"] == "shutting_down", response.text
    assert response.headers["retry-after"] == "1"          # as a request refused at shutdown is told
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_generated_tokens_count_every_sample(make_engine, live_server):
    engine = make_engine()
    app = build_app(engine, ServerConfig(model_name="tiny"))
    server = live_server(app)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        body = http.post("/v1/completions", json=completion(max_tokens=10, n=3, temperature=1.0, seed=1,
                                                            ignore_eos=True)).json()
    generated = app.state.metrics.registry.get_sample_value("loopstack_generation_tokens_total")
    assert generated == body["usage"]["completion_tokens"] == 30


def _accepts_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False
