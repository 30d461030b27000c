"""One API request end to end: its engine inputs (runtime/server/request_inputs.py) submitted to the
engine loop, and answered as one JSON body or as server-sent events in OpenAI's chunk format.

A prompt with `n` samples is one engine request whose samples are choices `prompt * n + sample`
(runtime/server/choices.py holds their state and shape).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from runtime.sampling_params import SamplingParams
from runtime.server.choices import Choice, Job, choice_body, chunk_maker
from runtime.server.engine_messages import EngineStopped, NewRequest, Overloaded, ShuttingDown
from runtime.server.protocol import APIError
from runtime.server.request_inputs import RequestInputs
from runtime.server.text import TextStream


class Generation(RequestInputs):
    """Turns API requests into engine requests and engine outputs into API responses; the checks and
    conversions of a request body it inherits, so the routes hold one object per model."""

    # ----- requests -> engine --------------------------------------------------------------------
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
        except EngineStopped as exc:                    # no retry helps: the server needs a restart
            raise APIError(503, str(exc), "service_unavailable", code="engine_stopped") from None
        except ShuttingDown as exc:
            raise APIError(503, str(exc), "service_unavailable", code="shutting_down",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except (ValueError, MemoryError) as exc:        # the engine's word on this input
            raise APIError(400, str(exc), param="messages" if kind == "chat" else "prompt") from None
        n = params[0].n
        echo = bool(getattr(body, "echo", False))
        choices = []
        for i, r in enumerate(requests):
            prefix = (r.prompt if r.prompt is not None else self._decode(r.prompt_token_ids)) if echo else ""
            choices += [Choice(i * n + j, r.request_id, j, len(r.prompt_token_ids), TextStream(),
                               prefix, list(r.prompt_token_ids)) for j in range(n)]
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)       # vLLM needs both
        return Job(kind, api_id, self.model_name, choices, outputs, include_usage, n, params[0].logprobs,
                   continuous, body.skip_special_tokens)

    # ----- engine -> responses -------------------------------------------------------------------
    async def events(self, job: Job) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, text delta) as outputs arrive, until every choice has finished. Aborts every
        unfinished engine request if cancelled."""
        try:
            while not all(c.finish_reason for c in job.choices):
                index, out = await job.outputs.get()
                mine = job.choices[index * job.num_samples:(index + 1) * job.num_samples]
                if out.prompt_logprobs is not None:
                    for choice in mine:
                        choice.prompt_logprobs = out.prompt_logprobs
                for sample in out.outputs:
                    if sample.index >= len(mine):
                        continue                    # best_of > n, cut off before the n best were chosen
                    choice = mine[sample.index]
                    if choice.finish_reason:
                        continue                    # the other samples' later outputs
                    delta = choice.update(sample)
                    if choice.finish_reason in ("error", "abort"):
                        choice.error = out.error
                    yield choice, delta
                for choice in mine:                 # the engine forgot the request (failed, aborted)
                    if out.finished and not choice.finish_reason:
                        choice.finish_reason, choice.error = out.finish_reason or "abort", out.error
                        yield choice, ""
        finally:
            for choice in job.choices[::job.num_samples]:
                group = job.choices[choice.index:choice.index + job.num_samples]
                if not all(c.finish_reason for c in group):
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
        _raise_failed(job, self.config.retry_after_s)
        body = {"id": job.api_id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
                "created": job.created, "model": job.model,
                "choices": [choice_body(self.tokenizer, job, c, c.prefix + c.text.text, c.logprobs,
                                            final=True, with_prompt=True) for c in job.choices],
                "usage": job.usage()}
        return JSONResponse(body)

    def stream(self, job: Job) -> StreamingResponse:
        return StreamingResponse(self._sse(job), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _sse(self, job: Job) -> AsyncIterator[str]:
        chunk = chunk_maker(job)
        if job.kind == "chat":                      # the role comes first, as OpenAI sends it
            for c in job.choices:
                yield _sse_data(chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                       "logprobs": None, "finish_reason": None}))
        started: set[int] = set()
        async with contextlib.aclosing(self.events(job)) as events:     # closed (and aborted) on return
            async for choice, delta in events:
                if choice.finish_reason == "error":       # then [DONE], as vLLM ends a failed stream
                    if job.include_usage:
                        yield _sse_data({**chunk(None), "choices": [], "usage": job.usage()})
                    yield _sse_data(_error(choice.error or "generation failed", "server_error"))
                    yield "data: [DONE]\n\n"
                    return
                first = choice.index not in started
                started.add(choice.index)
                new = choice.new_logprobs()
                if delta or choice.finish_reason or (first and choice.prefix) or new:
                    text = (choice.prefix if first else "") + delta
                    yield _sse_data(chunk(choice_body(self.tokenizer, job, choice, text, new,
                                                      bool(choice.finish_reason), is_delta=True,
                                                      with_prompt=first)))
                if choice.finish_reason == "abort":
                    if job.include_usage:              # what it generated before the stop still counts
                        yield _sse_data({**chunk(None), "choices": [], "usage": job.usage()})
                    yield _sse_data(_error("the server stopped before this request finished; retry",
                                           "service_unavailable", "shutting_down"))
                    yield "data: [DONE]\n\n"
                    return
        if job.include_usage:
            yield _sse_data({**chunk(None), "choices": [], "usage": job.usage()})
        yield "data: [DONE]\n\n"

    def _decode(self, ids: list[int]) -> str:
        # a token prompt echoed as given, special tokens too: its logprobs' tokens and text offsets
        # (choices._completion_logprobs) are of this text
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer is not None else ""


def _error(message: str, type: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


def _sse_data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _raise_failed(job: Job, retry_after_s: int) -> None:
    for c in job.choices:
        if c.finish_reason == "error":
            raise APIError(500, c.error or "generation failed", "server_error")
        if c.finish_reason == "abort":       # as a request refused at shutdown is told: when to retry
            raise APIError(503, "the server stopped before the request finished; retry",
                           "service_unavailable", code="shutting_down", headers={"Retry-After": str(retry_after_s)})


async def _drain(events: AsyncIterator[Any]) -> None:
    async with contextlib.aclosing(events):
        async for _ in events:
            pass


async def _disconnected(http_request: Request) -> None:
    """Returns when the client closes the connection (the body has been read by then)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass
