"""Bad input gets a 4xx with an OpenAI error object, never a crash: the table below is every input
tried and the status it must get."""
from __future__ import annotations

import json

import pytest

SERVE_EXTRA = "needs the serve extra: pip install -e '.[serve]'"
httpx = pytest.importorskip("httpx", reason=SERVE_EXTRA)
pytest.importorskip("fastapi", reason=SERVE_EXTRA)

import hal
from live_server import serving
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.server.app import build_app
from runtime.server.config import ServerConfig

MAX_BODY_BYTES = 16384     # room for the 5,000-digit cases below
OK = {"model": "tiny", "prompt": "the cat", "max_tokens": 2}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (case, method, path, body: dict -> JSON / bytes -> raw, status, param or None)
BAD_INPUTS = [
    ("malformed JSON", "POST", "/v1/completions", b'{"model": "tiny", "prompt": ', 400, None),
    ("body not an object", "POST", "/v1/completions", b"[1, 2]", 400, None),
    ("body not UTF-8", "POST", "/v1/completions", b"\xff\xfe\x00", 400, None),
    ("empty body", "POST", "/v1/completions", b"", 400, None),
    ("deeply nested JSON", "POST", "/v1/completions", b"[" * 1500 + b"]" * 1500, 400, None),
    ("model a list", "POST", "/v1/completions", {"prompt": "hi", "model": ["tiny"]}, 400, "model"),
    ("missing prompt", "POST", "/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("unknown model", "POST", "/v1/completions", {**OK, "model": "gpt-4"}, 404, "model"),
    ("model not a string", "POST", "/v1/completions", {**OK, "model": 7}, 400, "model"),
    ("max_tokens a string", "POST", "/v1/completions", {**OK, "max_tokens": "5"}, 400, "max_tokens"),
    ("max_tokens a float", "POST", "/v1/completions", {**OK, "max_tokens": 2.5}, 400, "max_tokens"),
    ("max_tokens a bool", "POST", "/v1/completions", {**OK, "max_tokens": True}, 400, "max_tokens"),
    ("max_tokens 0", "POST", "/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens over the context", "POST", "/v1/completions", {**OK, "max_tokens": 10_000}, 400,
     "max_tokens"),
    ("prompt over the context", "POST", "/v1/completions", {**OK, "prompt": [5] * 300}, 400, "prompt"),
    ("empty prompt", "POST", "/v1/completions", {**OK, "prompt": ""}, 400, "prompt"),
    ("empty prompt list", "POST", "/v1/completions", {**OK, "prompt": []}, 400, "prompt"),
    ("prompt a number", "POST", "/v1/completions", {**OK, "prompt": 123}, 400, "prompt"),
    ("prompt mixed list", "POST", "/v1/completions", {**OK, "prompt": ["a", 1]}, 400, "prompt"),
    ("token id out of the vocabulary", "POST", "/v1/completions", {**OK, "prompt": [5, 100_000]}, 400,
     "prompt"),
    ("negative token id", "POST", "/v1/completions", {**OK, "prompt": [5, -1]}, 400, "prompt"),
    ("temperature negative", "POST", "/v1/completions", {**OK, "temperature": -1}, 400, "temperature"),
    ("temperature a string", "POST", "/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature"),
    ("temperature NaN", "POST", "/v1/completions", b'{"model": "tiny", "prompt": "a", "temperature": NaN}',
     400, "temperature"),
    ("top_p 0", "POST", "/v1/completions", {**OK, "top_p": 0}, 400, "top_p"),
    ("seed below -2^63", "POST", "/v1/completions", {**OK, "seed": -2 ** 63 - 1}, 400, "seed"),
    ("stream a string", "POST", "/v1/completions", {**OK, "stream": "yes"}, 400, "stream"),
    ("unknown field (typo)", "POST", "/v1/completions", {**OK, "num_loop": 2}, 400, "num_loop"),
    ("n 0", "POST", "/v1/completions", {**OK, "n": 0}, 400, "n"),
    ("n over the limit", "POST", "/v1/completions", {**OK, "n": 1000}, 400, "n"),
    ("best_of below n", "POST", "/v1/completions", {**OK, "n": 3, "best_of": 2}, 400, "best_of"),
    ("best_of > n streamed", "POST", "/v1/completions", {**OK, "best_of": 2, "stream": True}, 400, "best_of"),
    ("logprobs over 20", "POST", "/v1/completions", {**OK, "logprobs": 21}, 400, "logprobs"),
    ("logprobs negative", "POST", "/v1/completions", {**OK, "logprobs": -1}, 400, "logprobs"),
    ("suffix", "POST", "/v1/completions", {**OK, "suffix": "x"}, 400, "suffix"),
    ("presence_penalty 3", "POST", "/v1/completions", {**OK, "presence_penalty": 3}, 400, "presence_penalty"),
    ("frequency_penalty -3", "POST", "/v1/completions", {**OK, "frequency_penalty": -3}, 400,
     "frequency_penalty"),
    ("repetition_penalty 0", "POST", "/v1/completions", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("logit_bias key not a token id", "POST", "/v1/completions", {**OK, "logit_bias": {"cat": 5}}, 400,
     "logit_bias"),
    ("logit_bias value over 100", "POST", "/v1/completions", {**OK, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias token outside the vocabulary", "POST", "/v1/completions", {**OK, "logit_bias": {"100000": 1}},
     400, "logit_bias"),
    ("min_tokens over max_tokens", "POST", "/v1/completions", {**OK, "min_tokens": 5}, 400, "min_tokens"),
    ("chat: min_tokens over what the context leaves", "POST", "/v1/chat/completions",
     {"model": "tiny", "messages": CHAT["messages"], "min_tokens": 600}, 400, "min_tokens"),
    ("chat: messages over the context", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "the cat " * 300}]}, 400, "messages"),
    ("an integer of 5,000 digits", "POST", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000
     + b"}", 400, None),
    ("logit_bias key of 5,000 digits", "POST", "/v1/completions", {**OK, "logit_bias": {"9" * 5000: 1}}, 400,
     "logit_bias"),
    ("temperature past float32", "POST", "/v1/completions", {**OK, "temperature": 1e39}, 400, "temperature"),
    ("temperature Infinity", "POST", "/v1/completions", b'{"prompt": "a", "temperature": Infinity}', 400,
     "temperature"),
    ("presence_penalty NaN", "POST", "/v1/completions", b'{"prompt": "a", "presence_penalty": NaN}', 400,
     "presence_penalty"),
    ("repetition_penalty past float32", "POST", "/v1/completions", {**OK, "repetition_penalty": 1e39}, 400,
     "repetition_penalty"),
    ("tokenize: another model", "POST", "/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("detokenize: another model", "POST", "/detokenize", {"tokens": [5], "model": "gpt-4"}, 404, "model"),
    ("num_loops 0", "POST", "/v1/completions", {**OK, "num_loops": 0}, 400, "num_loops"),
    ("num_loops over the limit", "POST", "/v1/completions", {**OK, "num_loops": 1000}, 400, "num_loops"),
    ("exit_threshold 1.5", "POST", "/v1/completions", {**OK, "exit_threshold": 1.5}, 400, "exit_threshold"),
    ("empty stop string", "POST", "/v1/completions", {**OK, "stop": [""]}, 400, "stop"),
    ("too many stop strings", "POST", "/v1/completions", {**OK, "stop": [f"s{i}" for i in range(20)]}, 400,
     "stop"),
    ("stop a number", "POST", "/v1/completions", {**OK, "stop": 5}, 400, "stop"),
    ("chat: no messages", "POST", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat: messages a string", "POST", "/v1/chat/completions", {**CHAT, "messages": "hi"}, 400, "messages"),
    ("chat: message without role", "POST", "/v1/chat/completions", {**CHAT, "messages": [{"content": "hi"}]},
     400, "messages.0.role"),
    ("chat: image part", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages.0.content"),
    ("chat: prompt field", "POST", "/v1/chat/completions", {**CHAT, "prompt": "hi"}, 400, "prompt"),
    ("chat: tools", "POST", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat: unknown role", "POST", "/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]},
     400, "messages.0.role"),
    ("chat: top_logprobs without logprobs", "POST", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("chat: top_logprobs over 20", "POST", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 30},
     400, "top_logprobs"),
    ("chat: max_completion_tokens over the context", "POST", "/v1/chat/completions",
     {**CHAT, "max_completion_tokens": 10_000}, 400, "max_completion_tokens"),
    ("top_k past 2^31", "POST", "/v1/completions", {**OK, "temperature": 1.0, "top_k": 2 ** 63}, 400, "top_k"),
    ("stop_token_ids past int64", "POST", "/v1/completions", {**OK, "stop_token_ids": [10 ** 23]}, 400,
     "stop_token_ids"),
    ("stop_token_ids outside the vocabulary", "POST", "/v1/completions", {**OK, "stop_token_ids": [10 ** 9]}, 400,
     "stop_token_ids"),
    ("logit_bias key of non-ASCII digits", "POST", "/v1/completions", {**OK, "logit_bias": {"\u00b2": 1}}, 400,
     "logit_bias"),
    ("prompt with a lone surrogate", "POST", "/v1/completions", {**OK, "prompt": "\ud800 hi"}, 400, "prompt"),
    ("chat: content with a lone surrogate", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "\udc00"}]}, 400, "messages"),
    ("tokenize: a lone surrogate", "POST", "/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    ("chat_template_kwargs repeating the call's arguments", "POST", "/v1/chat/completions",
     {**CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}, 400, "chat_template_kwargs"),
    ("chat: enable_thinking without a think token", "POST", "/v1/chat/completions",
     {**CHAT, "chat_template_kwargs": {"enable_thinking": True}}, 400, "chat_template_kwargs"),
    ("completions: stream_options without stream", "POST", "/v1/completions",
     {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("more prompts than the server ever takes", "POST", "/v1/completions", {**OK, "prompt": [[1]] * 513}, 400,
     "prompt"),
    ("body over the limit", "POST", "/v1/completions", {**OK, "prompt": "a " * MAX_BODY_BYTES}, 413, None),
    ("GET on a POST route", "GET", "/v1/completions", None, 405, None),
    ("POST on a GET route", "POST", "/v1/models", {}, 405, None),
    ("unknown route", "GET", "/v1/engines", None, 404, None),
]


@pytest.fixture(scope="module")
def server(tiny_model, tokenizer):
    engine = LLMEngine(tiny_model, hal.get("cpu"), EngineConfig(num_kv_blocks=256, max_num_loops=8), tokenizer)
    yield from serving(engine, ServerConfig(model_name="tiny", max_body_bytes=MAX_BODY_BYTES))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.mark.parametrize("case,method,path,body,status,param", BAD_INPUTS, ids=[row[0] for row in BAD_INPUTS])
def test_bad_input_gets_an_openai_error(http, case, method, path, body, status, param):
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    response = http.request(method, path, content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


def test_a_body_streamed_past_the_limit_without_length_gets_413(http):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(2 * MAX_BODY_BYTES // 64):
            yield b"a" * 64
        yield b'"}'
    response = http.post("/v1/completions", content=chunks())
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_an_error_message_quotes_a_huge_value_shortened(http):
    response = http.post("/v1/completions", json={**OK, "logit_bias": {"9" * 5000: 1}})
    assert response.status_code == 400 and len(response.json()["error"]["message"]) < 400


def test_null_takes_the_default_and_head_answers_the_probes(http):
    """OpenAI clients send null for a field they leave unset ("stream": null): the default, as vLLM
    takes it; an unknown field stays refused, null or not. Load balancers probe with HEAD."""
    nulls = dict.fromkeys(["stream", "echo", "ignore_eos", "skip_special_tokens", "n", "temperature", "logprobs",
                           "add_special_tokens", "include_stop_str_in_output", "stream_options"])
    response = http.post("/v1/completions", json={**OK, **nulls})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == http.post("/v1/completions", json=OK).json()["choices"][0]["text"]
    chat = http.post("/v1/chat/completions", json={**CHAT, "stream": None, "add_generation_prompt": None})
    assert chat.status_code == 200, chat.text
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, CHAT["messages"][0]]
    assert http.post("/v1/chat/completions", json={**CHAT, "messages": history}).status_code == 200
    unknown = http.post("/v1/completions", json={**OK, "num_loop": None})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "num_loop"
    assert http.head("/health").status_code == 200 and http.head("/v1/models").status_code == 200


def test_the_server_still_serves_after_the_table(http, server):
    assert http.get("/health").status_code == 200
    response = http.post("/v1/completions", json=OK)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    unnamed = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})     # the served model
    assert unnamed.status_code == 200 and unnamed.json()["model"] == "tiny"
    state = server.loop.state
    assert state.num_free_blocks == state.num_blocks and server.loop.num_in_flight == 0
    assert "loopstack_rejected_requests_total" in http.get("/metrics").text


def test_an_engine_failure_is_a_500_or_a_stream_error_not_a_crash(make_engine, live_server, monkeypatch):
    engine = make_engine()

    def broken_step():
        raise RuntimeError("device lost")
    monkeypatch.setattr(engine, "step", broken_step)
    server = live_server(build_app(engine, ServerConfig(model_name="tiny")))
    with httpx.Client(base_url=server.url, timeout=60) as http:
        response = http.post("/v1/completions", json=OK)
        assert response.status_code == 500 and "device lost" in response.json()["error"]["message"]
        streamed = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
        assert streamed.status_code == 200                  # the headers went out before the failure
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "device lost" in events[-1]["error"]["message"]
        assert streamed.text.rstrip().endswith("data: [DONE]")   # the stream still ends as vLLM's
        assert http.get("/version").json()["version"]
        assert http.get("/health").status_code == 200      # still serving
    assert server.loop.num_in_flight == 0 and not engine.has_unfinished_requests()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_failed_tensor_parallel_step_stops_the_server_and_says_why(make_engine, live_server, monkeypatch):
    """Under tensor parallelism a failed step ends the loop: the request in flight gets the cause, and
    later ones and /health a 503 that names it, without a Retry-After (only a restart helps), not
    "shutting down"."""
    engine = make_engine()

    def broken_step():
        raise RuntimeError("device lost")
    monkeypatch.setattr(engine, "step", broken_step)
    monkeypatch.setattr(type(engine), "is_tensor_parallel", property(lambda self: True))
    server = live_server(build_app(engine, ServerConfig(model_name="tiny")))
    with httpx.Client(base_url=server.url, timeout=60) as http:
        first = http.post("/v1/completions", json=OK)
        assert first.status_code == 500 and "device lost" in first.json()["error"]["message"]
        assert "restart it" in first.json()["error"]["message"]
        server.loop._thread.join(10)
        for response in (http.post("/v1/completions", json=OK), http.get("/health")):
            message = response.json()["error"]["message"]
            assert response.status_code == 503 and "Retry-After" not in response.headers
            assert "device lost" in message and "tensor parallelism" in message and "shutting down" not in message


def test_an_api_key_guards_the_openai_routes_and_cors_answers_browsers(make_engine, live_server, monkeypatch):
    """With server.api_key, /v1/* needs `Authorization: Bearer <key>` (401 with an OpenAI error
    otherwise), while /health, /metrics and /tokenize stay open, as in vLLM; the CLI takes the key
    from LOOPSTACK_API_KEY too. CORS answers a browser's preflight and marks refused answers."""
    from hydra import compose, initialize_config_dir

    from runtime.cli import CONF_DIR
    from runtime.serve import server_config

    server = live_server(build_app(make_engine(), ServerConfig(model_name="tiny", api_key="s3cret",
                                                               allowed_origins=("https://app.example",))))
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            refused = http.post("/v1/completions", json=OK, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/v1/models").status_code == 401
        key = {"Authorization": "Bearer s3cret"}
        assert http.post("/v1/completions", json=OK, headers=key).json()["usage"]["completion_tokens"] >= 1
        assert http.get("/v1/models", headers=key).json()["data"][0]["id"] == "tiny"
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        assert http.post("/tokenize", json={"prompt": "the cat"}).status_code == 200
        assert 'loopstack_rejected_requests_total{reason="unauthorized"} 4.0' in http.get("/metrics").text
        origin = {"Origin": "https://app.example"}
        asks = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        preflight = http.options("/v1/completions", headers={**origin, **asks})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert http.post("/v1/completions", json=OK, headers=origin).headers[
            "access-control-allow-origin"] == "https://app.example"
        elsewhere = http.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in elsewhere.headers
    # behind a root path or mounted in another app, the key still guards /v1 (as the router sees it)
    from starlette.applications import Starlette
    from starlette.routing import Mount

    inner = build_app(make_engine(), ServerConfig(model_name="t", api_key="k"))
    outer = Starlette(routes=[Mount("/llm", app=inner)])
    outer.state.engine_loop = inner.state.engine_loop        # what the graceful shutdown drains
    mounted = live_server(outer)
    with httpx.Client(base_url=mounted.url, timeout=60) as http:
        assert http.get("/llm/v1/models").status_code == 401
        assert http.get("/llm/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert http.get("/llm/v1foo").status_code == 404          # not under /v1: routing answers
    plain = live_server(build_app(make_engine(), ServerConfig(model_name="tiny")))
    with httpx.Client(base_url=plain.url, timeout=60) as http:    # no CORS unless origins are named
        preflight = http.options("/v1/completions", headers={"Origin": "https://app.example",
                                                             "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in preflight.headers
    assert "s3cret" not in repr(ServerConfig(api_key="s3cret"))
    assert ServerConfig(allowed_origins="https://a.example").allowed_origins == ("https://a.example",)
    monkeypatch.setenv("LOOPSTACK_API_KEY", "from-env")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        assert server_config(compose("serve", overrides=["model.path=/x"])).api_key == "from-env"
        given = compose("serve", overrides=["model.path=/x", "server.api_key=cli"])
        assert server_config(given).api_key == "cli"
    with pytest.raises(ValueError, match="api_key must be a non-empty string"):
        ServerConfig(api_key="  ")


def test_the_default_max_tokens_fits_the_cache_at_the_requests_depth(tiny_model, tokenizer, live_server):
    """Without max_tokens a request may generate what its depth's KV planes leave room for: 40 blocks
    of 16 hold 161 tokens of a 4-loop request but 81 of an 8-loop one, so chat's default (the rest of
    the context) must shrink at 8 loops instead of failing admission with "lower max_tokens", which
    the client never sent; where not even the prompt fits, the 400 names num_loops."""
    engine = LLMEngine(tiny_model, hal.get("cpu"), EngineConfig(num_kv_blocks=40, max_num_loops=64), tokenizer)
    server = live_server(build_app(engine, ServerConfig(model_name="tiny")))
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        deep = client.post("/v1/chat/completions", json={**chat, "num_loops": 8})
        assert deep.status_code == 200, deep.text
        usage = deep.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == engine.max_request_len(8) == 81
        assert deep.json()["choices"][0]["finish_reason"] == "length"
        # an explicit max_tokens past that room is the client's to lower, and the 400 says by how much
        over = client.post("/v1/completions", json={"model": "tiny", "prompt": "the cat sat", "num_loops": 8,
                                                    "max_tokens": 100})
        error = over.json()["error"]
        assert over.status_code == 400 and (error["param"], error["code"]) == ("max_tokens", "context_length_exceeded")
        assert "ask for at most" in error["message"] and "cmpl-" not in error["message"], error
        deepest = client.post("/v1/completions", json={"model": "tiny", "prompt": "the cat sat", "num_loops": 64})
        assert deepest.status_code == 400 and deepest.json()["error"]["param"] == "num_loops", deepest.text
        # the 8-loop request grew the engine's planes; a request at the model's depth keeps its room
        plain = client.post("/v1/chat/completions", json=chat).json()["usage"]
        assert plain["prompt_tokens"] + plain["completion_tokens"] == engine.max_request_len(4) == 161
