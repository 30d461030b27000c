"""An admitted request's answer as it grows (`Job`, one `Choice` per sample) and its OpenAI shape.

Completions and chat differ only in the shape of a choice (`text` vs. `message` / `delta`, and of
`logprobs`); the JSON body and the stream chunks are built from the same choice bodies.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import time
from typing import Any, Callable

from runtime.engine.outputs import TokenLogprobs
from runtime.server.text import REPLACEMENT, TextStream
from runtime.text.detokenizer import IncrementalDetokenizer
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
    prefix: str = ""                     # echo: the prompt's text, sent before the answer
    prompt_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # echo with logprobs
    offset_text: Any = None              # the answer's tokens given a text_offset so far (`_Offsets`)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    num_logprobs_sent: int = 0

    def update(self, sample: Any) -> str:
        """Take the engine's latest state of this sample (a `CompletionOutput`); the text delta to send."""
        delta = self.text.update(sample.text, sample.finished)
        self.num_tokens = len(sample.token_ids)
        self.logprobs = list(sample.logprobs or [])[:self.num_tokens]
        if sample.finished:
            self.finish_reason, self.stop_reason = sample.finish_reason or "stop", sample.stop_reason
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
    continuous_usage: bool = False       # vLLM's stream_options.continuous_usage_stats: usage on every chunk
    skip_special_tokens: bool = True     # as the answer's text: its logprobs' text offsets follow it
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def usage(self) -> dict[str, int]:
        prompt = sum(c.num_prompt_tokens for c in self.choices[::self.num_samples])
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def choice_body(tokenizer: Tokenizer | None, job: Job, choice: Choice, text: str,
                logprobs: list[TokenLogprobs], final: bool, is_delta: bool = False,
                with_prompt: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"index": choice.index}
    if job.kind == "chat":
        body["delta" if is_delta else "message"] = {"content": text} if is_delta else \
            {"role": "assistant", "content": text}
    else:
        body["text"] = text
    body["logprobs"] = None
    if job.num_logprobs is not None:
        body["logprobs"] = _chat_logprobs(tokenizer, logprobs) if job.kind == "chat" else \
            _completion_logprobs(tokenizer, choice, logprobs, with_prompt, job.skip_special_tokens)
    reason = choice.finish_reason
    body["finish_reason"] = (ABORTED_FINISH_REASON if reason == "abort" else reason) if final else None
    body["stop_reason"] = choice.stop_reason if final else None       # vLLM's field
    return body


def chunk_maker(job: Job) -> Callable[[dict[str, Any] | None], dict[str, Any]]:
    kind = "chat.completion.chunk" if job.kind == "chat" else "text_completion"

    def chunk(choice: dict[str, Any] | None) -> dict[str, Any]:
        body = {"id": job.api_id, "object": kind, "created": job.created, "model": job.model,
                "choices": [] if choice is None else [choice]}
        if job.include_usage or job.continuous_usage:
            body["usage"] = job.usage() if job.continuous_usage and choice is not None else None
        return body
    return chunk


def _completion_logprobs(tokenizer: Tokenizer | None, choice: Choice, logprobs: list[TokenLogprobs],
                         with_prompt: bool, skip_special_tokens: bool = True) -> dict[str, Any]:
    """OpenAI's completions shape: parallel lists of tokens, their logprobs, the top logprobs as
    {token text: logprob} and each token's character offset in the returned text; with echo the
    prompt's tokens come first (the first one has no logprob: nothing predicts it)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add(token_id: int, lp: TokenLogprobs | None, offset: int) -> None:
        # the top k and the token itself (vLLM's and the legacy OpenAI API's k or k + 1 entries)
        names = _token_names(tokenizer, [token_id] if lp is None else list(lp))
        out["tokens"].append(names[token_id])
        out["token_logprobs"].append(lp.logprob if lp is not None else None)
        out["top_logprobs"].append({names[t]: v.logprob for t, v in lp.items()} if lp is not None else None)
        out["text_offset"].append(offset)

    if with_prompt and choice.prompt_logprobs is not None:
        prompt = _Offsets(tokenizer, skip_special_tokens=False)      # the prompt's text as given
        added = _num_added_bos(tokenizer, choice)
        for i, (token_id, lp) in enumerate(zip(choice.prompt_ids, choice.prompt_logprobs)):
            add(token_id, lp, 0 if i < added else prompt.next(token_id))
    if choice.offset_text is None:
        choice.offset_text = _Offsets(tokenizer, len(choice.prefix), skip_special_tokens)
    for lp in logprobs:
        add(lp.token_id, lp, choice.offset_text.next(lp.token_id))
    return out


def _num_added_bos(tokenizer: Tokenizer | None, choice: Choice) -> int:
    """1 where the prompt's ids start with a BOS its echoed text does not (the one encoding a text
    prompt adds, `Tokenizer.encode_prompt`): that token takes no room in the text, so the offsets
    after it are not pushed along by its length."""
    bos = tokenizer.special_token("bos_token") if tokenizer is not None else None
    leads = bool(bos) and choice.prompt_ids[:1] == [tokenizer.token_id(bos)]
    return int(leads and not choice.prefix.startswith(bos))


class _Offsets:
    """Each token's character offset in a text: where the text of the tokens before it ends (a
    character split over byte tokens starts where its first byte token is), from `base` on."""

    def __init__(self, tokenizer: Tokenizer | None, base: int = 0, skip_special_tokens: bool = True) -> None:
        self.base, self.ids, self.length = base, [], 0     # `length`: without a tokenizer, of "<id>" texts
        self.text = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer else None
        self.before = ""               # the text of `ids`, characters not complete yet as U+FFFD

    def next(self, token_id: int) -> int:
        if self.text is None:
            offset = self.base + self.length
            self.length += len(_token_text(None, token_id))
            return offset
        self.ids.append(token_id)
        before, after = self.before, self.text.with_pending(self.ids)
        self.before = after
        added = after[len(before):] if after.startswith(before) else None
        if added == "" and self.text.tokenizer.decode([token_id]) == "":
            return self.base + len(before)       # a special token the text skips
        if before.endswith(REPLACEMENT) and added is not None and not added.strip(REPLACEMENT):
            # a byte that leaves its character incomplete (a byte-level decoder shows one U+FFFD for
            # the pending bytes, a byte-fallback one a U+FFFD per byte): the character's start. (A
            # second stray byte after a stray byte looks the same; it gets the first one's offset.)
            return self.base + len(before.rstrip(REPLACEMENT))
        # where the two texts part: after the text before, or at a character this token completes
        return self.base + len(os.path.commonprefix([before, after]))


def _chat_logprobs(tokenizer: Tokenizer | None, logprobs: list[TokenLogprobs]) -> dict[str, Any]:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    def entry(token_id: int, value: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        raw = tokenizer.token_bytes(token_id) if tokenizer is not None else text.encode("utf-8")
        return {"token": text, "logprob": value, "bytes": list(raw)}
    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


def _token_names(tokenizer: Tokenizer | None, token_ids: list[int]) -> dict[int, str]:
    """The completions API's names for the tokens of one position, distinct so that no top_logprobs
    entry overwrites another: a token's text, or where its bytes are part of a character (a lone
    byte of a multi-byte one, which decodes to U+FFFD) the legacy API's `bytes:\\xe6\\x97` form; two
    tokens whose texts still agree (a decoder that drops a leading space) are named `token_id:N`,
    vLLM's form."""
    names = {t: _completion_token(tokenizer, t) for t in token_ids}
    counts = collections.Counter(names.values())
    return {t: name if counts[name] == 1 else f"token_id:{t}" for t, name in names.items()}


def _completion_token(tokenizer: Tokenizer | None, token_id: int) -> str:
    if tokenizer is None:
        return _token_text(None, token_id)
    raw = tokenizer.token_bytes(token_id)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return _token_text(tokenizer, token_id)


def _token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    if tokenizer is None:
        return f"<{token_id}>"
    return tokenizer.token_text(token_id)
