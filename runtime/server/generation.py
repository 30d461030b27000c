"""One API request end to end: its prompts and sampling settings checked and tokenized, submitted
to the engine loop, and answered as one JSON body or as server-sent events in OpenAI's chunk format.

Completions and chat share everything but the prompt (text or token ids vs. messages rendered by
the chat template) and the shape of a choice (`text` vs. `message` / `delta`, and of `logprobs`).
A prompt with `n` samples is one engine request whose samples are choices `prompt * n + sample`.
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
from runtime.engine.outputs import TokenLogprobs
from runtime.server.engine_loop import EngineLoop, NewRequest, Overloaded, ShuttingDown
from runtime.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, unsupported_field
from runtime.server.text import TextStream
from runtime.text.chat import apply_chat_template
from runtime.text.tokenizer import Tokenizer

# the OpenAI finish reason of a request the server stopped (shutdown): the stream also gets an error
ABORTED_FINISH_REASON = "length"


@dataclasses.dataclass
class Choice:
    """One sample's answer as it grows."""
    index: int
    request_id: str                      # the engine request (one per prompt)
    sample: int                          # which of its samples
    num_prompt_tokens: int
    text: TextStream
    min_tokens: int = 0                  # stop strings count only from this many tokens on
    prefix: str = ""                     # echo: the prompt's text, sent before the answer
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # echo with logprobs
    offset: int = 0                      # logprobs' text_offset of the next token
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    num_logprobs_sent: int = 0

    def update(self, sample: Any) -> str:
        """Take the engine's latest state of this sample (a `CompletionOutput`); the text delta to send."""
        delta, is_stopped = self.text.update(sample.text, sample.finished,
                                             check_stop=len(sample.token_ids) >= self.min_tokens)
        self.num_tokens = len(sample.token_ids)
        self.logprobs = list(sample.logprobs or [])[:self.num_tokens]
        if is_stopped:
            self.finish_reason = "stop"
        elif sample.finished:
            self.finish_reason = sample.finish_reason or "stop"
        return delta

    def new_logprobs(self) -> list[TokenLogprobs]:
        new = self.logprobs[self.num_logprobs_sent:]
        self.num_logprobs_sent = len(self.logprobs)
        return new


@dataclasses.dataclass
class Job:
    """An admitted API request."""
    kind: str                            # "completion" | "chat"
    api_id: str
    model: str
    choices: list[Choice]
    outputs: asyncio.Queue               # (prompt index, RequestOutput) from the engine loop
    include_usage: bool
    num_samples: int                     # choices per prompt (n)
    num_logprobs: int | None             # top logprobs per token, when the request asked for logprobs
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def usage(self) -> dict[str, int]:
        prompt = sum(c.num_prompt_tokens for c in self.choices[::self.num_samples])
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Generation:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, loop: EngineLoop, tokenizer: Tokenizer | None, model_name: str, config: Any) -> None:
        self.loop, self.tokenizer, self.model_name, self.config = loop, tokenizer, model_name, config
        self.max_model_len = loop.engine.max_model_len
        self.max_num_loops = loop.engine.config.max_num_loops

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
        if not all(stop):
            raise APIError(400, "stop strings must be non-empty (an empty string would end every answer at "
                                "once); leave stop out to stop only at the model's end token", param="stop")
        if len(stop) > self.config.max_num_stop_strings:
            raise APIError(400, f"stop takes at most {self.config.max_num_stop_strings} strings, got "
                                f"{len(stop)}", param="stop")
        num_loops = body.num_loops or self.config.default_num_loops
        if num_loops is not None and num_loops > self.max_num_loops:
            raise APIError(400, f"num_loops={num_loops} is above this server's limit of "
                                f"{self.max_num_loops} (engine.max_num_loops)", param="num_loops")
        vocab = self.loop.engine.model.config.vocab_size
        for name, value in (body.logit_bias or {}).items():
            if not (name.isdigit() and int(name) < vocab and -100 <= value <= 100):
                raise APIError(400, f"logit_bias maps token ids (strings of digits below the vocabulary size "
                                    f"{vocab}) to biases in [-100, 100]; got {name!r}: {value!r}", param="logit_bias")
        best_of = getattr(body, "best_of", None)
        if best_of is not None and best_of < (body.n or 1):
            raise APIError(400, f"best_of ({best_of}) must be at least n ({body.n})", param="best_of")
        if body.stream and best_of is not None and best_of > (body.n or 1):
            raise APIError(400, "best_of > n cannot be streamed: the best samples are known only at the end",
                           param="best_of")
        if isinstance(body, ChatCompletionRequest) and body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")

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
        if isinstance(body, ChatCompletionRequest):
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            prompt_logprobs, best_of = None, None
        else:
            logprobs, best_of = body.logprobs, body.best_of
            prompt_logprobs = logprobs if body.echo and logprobs is not None else None
        defaults = self.config.sampling.resolve(body.temperature, body.top_p, body.top_k)
        defaults["top_k"] = max(defaults["top_k"], 0)          # -1: off, as 0
        try:
            return SamplingParams(
                max_tokens=max_tokens or min(self.config.default_max_tokens, room), **defaults,
                seed=body.seed, n=body.n or 1, best_of=best_of,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=body.repetition_penalty or 1.0,
                logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
                min_tokens=body.min_tokens or 0, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
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
        stop, n = body.stop_strings(), params[0].n
        echo = bool(getattr(body, "echo", False))
        choices = []
        for i, (r, p) in enumerate(zip(requests, params)):
            prefix = (r.prompt if r.prompt is not None else self._decode(r.prompt_token_ids)) if echo else ""
            choices += [Choice(i * n + j, r.request_id, j, len(r.prompt_token_ids), TextStream(stop),
                               p.min_tokens, prefix, list(r.prompt_token_ids)) for j in range(n)]
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return Job(kind, api_id, self.model_name, choices, outputs, include_usage, n, params[0].logprobs)

    # ----- engine -> responses -------------------------------------------------------------------
    async def events(self, job: Job) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, text delta) as outputs arrive, until every choice has finished. Aborts an
        engine request once stop strings ended all its samples, and every unfinished one if cancelled."""
        try:
            while not all(c.finish_reason for c in job.choices):
                index, out = await job.outputs.get()
                mine = job.choices[index * job.num_samples:(index + 1) * job.num_samples]
                if out.prompt_logprobs is not None:
                    for choice in mine:
                        choice.prompt_logprobs = out.prompt_logprobs
                for sample in out.outputs:
                    choice = mine[sample.index]
                    if choice.finish_reason:
                        continue                    # outputs after its stop string
                    delta = choice.update(sample)
                    if choice.finish_reason in ("error", "abort"):
                        choice.error = out.error
                    yield choice, delta
                for choice in mine:                 # the engine forgot the request (failed, aborted)
                    if out.finished and not choice.finish_reason:
                        choice.finish_reason, choice.error = out.finish_reason or "abort", out.error
                        yield choice, ""
                if not out.finished and all(c.finish_reason for c in mine):
                    self.loop.abort(mine[0].request_id, "stop")          # stop strings ended every sample
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
        _raise_failed(job)
        body = {"id": job.api_id, "object": "chat.completion" if job.kind == "chat" else "text_completion",
                "created": job.created, "model": job.model,
                "choices": [self._choice_body(job, c, c.prefix + c.text.text, c.logprobs, final=True,
                                              with_prompt=True) for c in job.choices],
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
        started: set[int] = set()
        async with contextlib.aclosing(self.events(job)) as events:     # closed (and aborted) on return
            async for choice, delta in events:
                if choice.finish_reason == "error":
                    yield _sse_data(_error(choice.error or "generation failed", "server_error"))
                    return
                first = choice.index not in started
                started.add(choice.index)
                new = choice.new_logprobs()
                if delta or choice.finish_reason or (first and choice.prefix) or new:
                    text = (choice.prefix if first else "") + delta
                    yield _sse_data(chunk(self._choice_body(job, choice, text, new, bool(choice.finish_reason),
                                                            is_delta=True, with_prompt=first)))
                if choice.finish_reason == "abort":
                    yield _sse_data(_error("the server stopped before this request finished; retry",
                                           "service_unavailable", "shutting_down"))
                    yield "data: [DONE]\n\n"
                    return
        if job.include_usage:
            yield _sse_data({**chunk(None), "choices": [], "usage": job.usage()})
        yield "data: [DONE]\n\n"

    # ----- the shape of a choice -----------------------------------------------------------------
    def _choice_body(self, job: Job, choice: Choice, text: str, logprobs: list[TokenLogprobs], final: bool,
                     is_delta: bool = False, with_prompt: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"index": choice.index}
        if job.kind == "chat":
            body["delta" if is_delta else "message"] = {"content": text} if is_delta else \
                {"role": "assistant", "content": text}
        else:
            body["text"] = text
        body["logprobs"] = None
        if job.num_logprobs is not None:
            body["logprobs"] = self._chat_logprobs(logprobs) if job.kind == "chat" else \
                self._completion_logprobs(choice, logprobs, with_prompt)
        reason = choice.finish_reason
        body["finish_reason"] = (ABORTED_FINISH_REASON if reason == "abort" else reason) if final else None
        return body

    def _completion_logprobs(self, choice: Choice, logprobs: list[TokenLogprobs],
                             with_prompt: bool) -> dict[str, Any]:
        """OpenAI's completions shape: parallel lists of tokens, their logprobs, the top logprobs as
        {token text: logprob} and each token's character offset in the returned text; with echo the
        prompt's tokens come first (the first one has no logprob: nothing predicts it)."""
        entries: list[tuple[int, TokenLogprobs | None]] = []
        if with_prompt and choice.prefix and choice.prompt_logprobs is not None:
            entries = list(zip(choice.prompt_ids, choice.prompt_logprobs))
        entries += [(lp.token_id, lp) for lp in logprobs]
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in entries:
            token = self._token_text(token_id)
            out["tokens"].append(token)
            out["token_logprobs"].append(lp.logprob if lp else None)
            out["top_logprobs"].append({self._token_text(t): v for t, v in lp.top} if lp else None)
            out["text_offset"].append(choice.offset)
            choice.offset += len(token)
        return out

    def _chat_logprobs(self, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
        """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
        def entry(token_id: int, value: float) -> dict[str, Any]:
            text = self._token_text(token_id)
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}
        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"<{token_id}>"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""


def _chunk_maker(job: Job) -> Callable[[dict[str, Any] | None], dict[str, Any]]:
    kind = "chat.completion.chunk" if job.kind == "chat" else "text_completion"

    def chunk(choice: dict[str, Any] | None) -> dict[str, Any]:
        body = {"id": job.api_id, "object": kind, "created": job.created, "model": job.model,
                "choices": [] if choice is None else [choice]}
        if job.include_usage:
            body["usage"] = None
        return body
    return chunk


def _error(message: str, type: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": None, "code": code}}


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
