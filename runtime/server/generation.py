"""One API request end to end: its prompts and sampling settings checked and tokenized, submitted
to the engine loop, and answered as one JSON body or as server-sent events in OpenAI's chunk format.

Completions and chat share everything but the prompt (text or token ids vs. messages rendered by
the chat template) and the shape of a choice (`text` vs. `message` / `delta`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from runtime.config import SamplingParams
from runtime.text.chat import apply_chat_template
from runtime.server.engine_loop import EngineLoop, NewRequest, Overloaded, ShuttingDown
from runtime.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, unsupported_field
from runtime.server.text import TextStream
from runtime.text.tokenizer import Tokenizer


@dataclasses.dataclass
class Choice:
    """One prompt's answer as it grows."""
    index: int
    request_id: str
    num_prompt_tokens: int
    text: TextStream
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    def update(self, out: Any) -> str:
        """Take the engine's latest output; the text delta to send."""
        delta, is_stopped = self.text.update(out.text, out.finished)
        self.num_tokens = len(out.token_ids)
        if is_stopped:
            self.finish_reason = "stop"
        elif out.finished:
            self.finish_reason, self.error = out.finish_reason or "stop", out.error
        return delta


@dataclasses.dataclass
class Job:
    """An admitted API request."""
    kind: str                            # "completion" | "chat"
    api_id: str
    model: str
    choices: list[Choice]
    outputs: asyncio.Queue               # (choice index, RequestOutput) from the engine loop
    include_usage: bool
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def usage(self) -> dict[str, int]:
        prompt = sum(c.num_prompt_tokens for c in self.choices)
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Generation:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, loop: EngineLoop, tokenizer: Tokenizer | None, model_name: str, config: Any) -> None:
        self.loop, self.tokenizer, self.model_name, self.config = loop, tokenizer, model_name, config
        self.max_model_len = loop.engine.max_model_len

    # ----- requests -> engine --------------------------------------------------------------------
    def check_common(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model != self.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.model_name!r} (see GET /v1/models)", "not_found_error", "model",
                           "model_not_found")
        field = unsupported_field(body)
        if field is not None:
            raise APIError(400, f"{field}={getattr(body, field)!r} is not supported by this server; leave it "
                                f"out", param=field)
        stop = body.stop_strings()
        if len(stop) > self.config.max_num_stop_strings or not all(stop):
            raise APIError(400, f"stop takes at most {self.config.max_num_stop_strings} non-empty strings",
                           param="stop")
        num_loops = body.num_loops or self.config.default_num_loops
        if num_loops is not None and num_loops > self.config.max_num_loops:
            raise APIError(400, f"num_loops={num_loops} is above this server's limit of "
                                f"{self.config.max_num_loops}", param="num_loops")

    def completion_prompts(self, body: CompletionRequest) -> list[tuple[list[int], str | None]]:
        prompt = body.prompt
        batch = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        if not batch:
            raise APIError(400, "prompt is empty: give a string or a list of token ids", param="prompt")
        return [self._encode(p, "prompt") if isinstance(p, str) else (list(p), None) for p in batch]

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], str | None]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so chat is unavailable; use /v1/completions "
                                "with token ids", param="messages")
        try:
            text = apply_chat_template(self.tokenizer, [m.as_template_input() for m in body.messages],
                                       add_generation_prompt=True, **(body.chat_template_kwargs or {}))
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None
        return self._encode(text, "messages")

    def _encode(self, text: str, param: str) -> tuple[list[int], str]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer.json: send the prompt as token ids", param=param)
        ids = self.tokenizer.encode(text)
        if not ids:
            raise APIError(400, f"{param} is empty (no tokens)", param=param)
        return ids, text

    def sampling_params(self, body: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int,
                        max_tokens: int | None, max_tokens_param: str = "max_tokens") -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(400, f"the prompt has {num_prompt_tokens} tokens; the model's context holds "
                                f"{self.max_model_len}, with room for at least one generated token",
                           param="prompt", code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"{max_tokens_param}={max_tokens} plus the prompt's {num_prompt_tokens} "
                                f"tokens exceeds the model's context of {self.max_model_len} tokens; ask "
                                f"for at most {room}", param=max_tokens_param, code="context_length_exceeded")
        try:
            return SamplingParams(
                max_tokens=max_tokens or min(self.config.default_max_tokens, room),
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=max(body.top_k or 0, 0),
                seed=body.seed,
                stop_token_ids=(*self.config.stop_token_ids, *(body.stop_token_ids or ())),
                ignore_eos=body.ignore_eos, num_loops=body.num_loops or self.config.default_num_loops,
                exit_threshold=body.exit_threshold if body.exit_threshold is not None
                else self.config.default_exit_threshold)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    async def submit(self, kind: str, body: Any, prompts: list[tuple[list[int], str | None]],
                     params: list[SamplingParams], arrival_time: float) -> Job:
        api_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        requests = [NewRequest(f"{api_id}-{i}", ids, p, text)
                    for i, ((ids, text), p) in enumerate(zip(prompts, params))]
        try:
            outputs = await self.loop.add(requests, arrival_time)
        except Overloaded as exc:
            raise APIError(429, str(exc), "rate_limit_error", code="server_overloaded",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except ShuttingDown as exc:
            raise APIError(503, str(exc), "service_unavailable", code="shutting_down",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except (ValueError, MemoryError) as exc:        # the engine's word on this input
            raise APIError(400, str(exc), param="messages" if kind == "chat" else "prompt") from None
        stop = body.stop_strings()
        choices = [Choice(i, r.request_id, len(r.prompt_token_ids), TextStream(stop))
                   for i, r in enumerate(requests)]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Job(kind, api_id, self.model_name, choices, outputs, include_usage)

    # ----- engine -> responses -------------------------------------------------------------------
    async def events(self, job: Job) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, text delta) as outputs arrive, until every choice has finished. Aborts the
        engine requests of choices a stop string ended, and of all unfinished ones if cancelled."""
        try:
            while not all(c.finish_reason for c in job.choices):
                index, out = await job.outputs.get()
                choice = job.choices[index]
                if choice.finish_reason:
                    continue                        # outputs after its stop string
                delta = choice.update(out)
                if choice.finish_reason and not out.finished:
                    self.loop.abort(choice.request_id, "stop")          # a stop string
                yield choice, delta
        finally:
            for choice in job.choices:
                if not choice.finish_reason:
                    self.loop.abort(choice.request_id)

    async def respond(self, job: Job, http_request: Request) -> Response:
        """The whole answer as one JSON body; the requests are aborted if the client leaves first."""
        collect = asyncio.ensure_future(_drain(self.events(job)))
        gone = asyncio.ensure_future(_disconnected(http_request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():
                collect.cancel()                    # its `finally` aborts the engine requests
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)       # nobody is listening
        collect.result()
        _raise_failed(job)
        body = {"id": job.api_id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
                "created": job.created, "model": job.model,
                "choices": [_choice_body(job.kind, c, c.text.text, final=True) for c in job.choices],
                "usage": job.usage()}
        return JSONResponse(body)

    def stream(self, job: Job) -> StreamingResponse:
        return StreamingResponse(self._sse(job), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _sse(self, job: Job) -> AsyncIterator[str]:
        chunk = _chunk_maker(job)
        if job.kind == "chat":                      # the role comes first, as OpenAI sends it
            for c in job.choices:
                yield _sse_data(chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}))
        async with contextlib.aclosing(self.events(job)) as events:     # closed (and aborted) on return
            async for choice, delta in events:
                if choice.finish_reason == "error":
                    yield _sse_data({"error": {"message": choice.error or "generation failed",
                                               "type": "server_error", "param": None, "code": None}})
                    return
                if delta or choice.finish_reason:
                    is_final = bool(choice.finish_reason)
                    yield _sse_data(chunk(_choice_body(job.kind, choice, delta, is_final, is_delta=True)))
        if job.include_usage:
            yield _sse_data({**chunk(None), "choices": [], "usage": job.usage()})
        yield "data: [DONE]\n\n"


def _choice_body(kind: str, choice: Choice, text: str, final: bool, is_delta: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"index": choice.index}
    if kind == "chat":
        body["delta" if is_delta else "message"] = {"content": text} if is_delta else \
            {"role": "assistant", "content": text}
    else:
        body["text"] = text
    body["logprobs"] = None
    body["finish_reason"] = choice.finish_reason if final else None
    return body


def _chunk_maker(job: Job) -> Callable[[dict[str, Any] | None], dict[str, Any]]:
    kind = "chat.completion.chunk" if job.kind == "chat" else "text_completion"

    def chunk(choice: dict[str, Any] | None) -> dict[str, Any]:
        body = {"id": job.api_id, "object": kind, "created": job.created, "model": job.model,
                "choices": [] if choice is None else [choice]}
        if job.include_usage:
            body["usage"] = None
        return body
    return chunk


def _sse_data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _raise_failed(job: Job) -> None:
    for c in job.choices:
        if c.finish_reason == "error":
            raise APIError(500, c.error or "generation failed", "server_error")
        if c.finish_reason == "abort":
            raise APIError(503, "the server stopped before the request finished; retry",
                           "service_unavailable", code="shutting_down")


async def _drain(events: AsyncIterator[Any]) -> None:
    async with contextlib.aclosing(events):
        async for _ in events:
            pass


async def _disconnected(http_request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass
