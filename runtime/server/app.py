"""The FastAPI app: OpenAI routes, health, metrics, errors, and the engine loop's lifetime.

    app = build_app(engine, ServerConfig(model_name="ouro-1.4b"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Every error is an OpenAI error object `{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx
status; no input takes the server down. The engine loop starts with the app (lifespan) and stops
with it: requests still in the engine then are aborted and their blocks freed (uvicorn's
`timeout_graceful_shutdown` is the time they get to finish first).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import time
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from runtime.engine.llm_engine import LLMEngine
from runtime.server.auth import RequireKey
from runtime.server.config import ServerConfig
from runtime.server.engine_loop import EngineLoop
from runtime.server.generation import Generation
from runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from runtime.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest, error_body, parse_request)
from runtime.server.request_inputs import checked_text

log = logging.getLogger(__name__)


def build_app(engine: LLMEngine, config: ServerConfig | None = None) -> FastAPI:
    """An app serving `engine` (which it then owns: only its loop thread may touch it)."""
    config = config or ServerConfig()
    metrics = ServerMetrics()
    loop = EngineLoop(engine, metrics, config.max_num_requests)
    model_name = config.model_name or _folder_name(engine) or "default"
    generation = Generation(loop, engine.tokenizer, model_name, config)
    if engine.tokenizer is not None:
        try:
            engine.tokenizer.chat_template_for()
        except ValueError as exc:               # the checkpoint's to fix: say so once, at start
            log.warning("chat requests will be refused: %s", exc)
    log.info("serving %s: requests that leave sampling out get the model's defaults: %s", model_name,
             config.sampling.describe())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop.start()
        yield
        await asyncio.to_thread(loop.shutdown)      # deliveries to open streams need this event loop

    app = FastAPI(title="loopstack", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_loop, app.state.metrics, app.state.model_name = loop, metrics, model_name
    if config.api_key is not None:
        app.add_middleware(RequireKey, api_key=config.api_key,
                           on_refused=lambda: metrics.rejected.labels("unauthorized").inc())
    # added last, so it runs first: a browser's preflight and a refused request both carry its headers
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    async def guarded(request: Request, handler: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await handler()
        except APIError as exc:
            metrics.rejected.labels(_reason(exc.status)).inc()
            return JSONResponse(exc.body(), exc.status, headers=exc.headers)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:                    # a bug: answer 500, keep serving
            log.exception("%s %s failed", request.method, request.url.path)
            metrics.rejected.labels("internal").inc()
            message = f"internal error: {type(exc).__name__}: {exc}"
            return JSONResponse(error_body(message, "server_error"), 500)

    async def generate(request: Request, kind: str) -> Response:
        arrival_time = time.monotonic()
        if kind == "chat":
            body = parse_request(ChatCompletionRequest, await read_json(request, config.max_body_bytes))
            generation.check_common(body)
            prompts = [generation.chat_prompt(body)]
            max_tokens_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            max_tokens = body.max_completion_tokens or body.max_tokens
        else:
            body = parse_request(CompletionRequest, await read_json(request, config.max_body_bytes))
            generation.check_common(body)
            prompts = generation.completion_prompts(body)
            max_tokens_param, max_tokens = "max_tokens", body.max_tokens
        params = [generation.sampling_params(body, len(ids), max_tokens, max_tokens_param)
                  for ids, _ in prompts]
        job = await generation.submit(kind, body, prompts, params, arrival_time)
        return generation.stream(job) if body.stream else await generation.respond(job, request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await guarded(request, lambda: generate(request, "completion"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await guarded(request, lambda: generate(request, "chat"))

    @app.api_route("/v1/models", methods=["GET", "HEAD"])      # HEAD: load balancers' probes
    async def models() -> dict[str, Any]:
        sampling = dataclasses.asdict(config.sampling)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "loopstack", "max_model_len": engine.max_model_len,
                                            "max_num_loops": engine.config.max_num_loops,
                                            "sampling_defaults": sampling}]}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": _package_version()}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if loop.is_accepting:
            return JSONResponse({"status": "ok", "requests_in_flight": loop.num_in_flight})
        if loop.stop_reason is not None:        # no retry helps: the server needs a restart
            return JSONResponse(error_body(loop.stop_reason, "service_unavailable"), 503)
        message = "the server is shutting down" if loop.is_alive else "the engine loop is not running"
        return JSONResponse(error_body(message, "service_unavailable"), 503,
                            headers={"Retry-After": str(config.retry_after_s)})

    # the tokenizer, for clients that count or build token ids themselves (lm-eval's remote tokenizer)
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await guarded(request, lambda: tokenizer_call(request, "tokenize"))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await guarded(request, lambda: tokenizer_call(request, "detokenize"))

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        return await guarded(request, lambda: tokenizer_call(request, "info"))

    async def tokenizer_call(request: Request, what: str) -> Response:
        tokenizer = engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer.json", code="no_tokenizer")
        if what == "info":
            return JSONResponse({**{k: tokenizer.special_token(k) for k in ("bos_token", "eos_token", "pad_token")},
                                 "chat_template": tokenizer.config.get("chat_template"),
                                 "model_max_length": engine.max_model_len, "vocab_size": tokenizer.vocab_size})
        cls = TokenizeRequest if what == "tokenize" else DetokenizeRequest
        body = parse_request(cls, await read_json(request, config.max_body_bytes))
        generation.check_model(body.model)
        if what == "tokenize":
            text = checked_text(body.prompt, "prompt")     # with special tokens: the ids a completion gets
            ids = tokenizer.encode_prompt(text) if body.add_special_tokens else tokenizer.encode(text)
            return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})
        vocab = engine.model.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:   # unknown route, wrong method
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}",
                                       "invalid_request_error"), exc.status_code, headers=exc.headers)

    return app


async def read_json(request: Request, max_body_bytes: int) -> Any:
    """The body as JSON: 413 past `max_body_bytes` (checked while reading), 400 when malformed."""
    too_large = APIError(413, f"the request body is larger than {max_body_bytes} bytes",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise too_large
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:   # JSONDecodeError, UnicodeDecodeError, an int past 4,300 digits
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def _reason(status: int) -> str:
    return {429: "overloaded", 503: "shutting_down", 413: "too_large", 404: "not_found"}.get(
        status, "invalid" if status < 500 else "internal")


def _package_version() -> str:
    try:
        return importlib.metadata.version("loopstack")
    except importlib.metadata.PackageNotFoundError:       # run from a checkout without installing
        return "unknown"


def _folder_name(engine: LLMEngine) -> str | None:
    path = getattr(engine.model, "name_or_path", None)
    return Path(path).name if path else None
