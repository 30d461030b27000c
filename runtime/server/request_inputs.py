"""An API request's engine inputs: the request checked against this server and its model, its
prompts tokenized (text, token ids, or chat messages rendered by the chat template) and its
sampling settings resolved against the server's defaults and the model's context.

Every refusal is an `APIError` (a 4xx answer) raised before anything reaches the engine loop, so
a request the server cannot serve never takes a place in its queue.
"""
from __future__ import annotations

from typing import Any

from runtime.sampling_params import SamplingParams
from runtime.server.engine_loop import EngineLoop
from runtime.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, unsupported_field
from runtime.text.chat import RESERVED_TEMPLATE_KWARGS, apply_chat_template
from runtime.text.tokenizer import Tokenizer


def checked_text(text: str, param: str) -> str:
    """`text`, refused with a 400 naming `param` where it is not valid Unicode (a lone surrogate such
    as "\\ud800", which JSON can carry and no tokenizer encodes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise APIError(400, f"{param} is not valid Unicode text ({exc.reason} at character {exc.start}): "
                            f"send UTF-8 text", param=param) from None
    return text


class RequestInputs:
    """Turns API request bodies into prompts and `SamplingParams` for the engine."""

    def __init__(self, loop: EngineLoop, tokenizer: Tokenizer | None, model_name: str, config: Any) -> None:
        self.loop, self.tokenizer, self.model_name, self.config = loop, tokenizer, model_name, config
        self.max_model_len = loop.engine.max_model_len
        self.max_num_loops = loop.engine.config.max_num_loops

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:     # left out: the one served
            raise APIError(404, f"the model {_shortened(model)!r} does not exist; this server serves "
                                f"{self.model_name!r} (see GET /v1/models)", "not_found_error", "model",
                           "model_not_found")

    def check_common(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        self.check_model(body.model)
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
            # the length first: int() of a key past 4,300 digits raises (Python's limit)
            if not (name.isascii() and name.isdigit() and len(name) <= len(str(vocab)) and int(name) < vocab
                    and -100 <= value <= 100):
                raise APIError(400, f"logit_bias maps token ids (strings of digits below the vocabulary size "
                                    f"{vocab}) to biases in [-100, 100]; got {_shortened(name)!r}: {value!r}",
                               param="logit_bias")
        bad_stops = [t for t in body.stop_token_ids or () if not 0 <= t < vocab]
        if bad_stops:           # the model can never sample them: such a stop would silently never fire
            raise APIError(400, f"stop_token_ids takes token ids below the vocabulary size {vocab}; got "
                                f"{bad_stops[:3]}", param="stop_token_ids")
        if body.stream_options is not None and not body.stream:      # OpenAI's and vLLM's rule
            raise APIError(400, "stream_options applies to streamed answers only: set stream=true or leave "
                                "stream_options out", param="stream_options")
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
        return [self._encode(p, "prompt", body.add_special_tokens) if isinstance(p, str) else (list(p), None)
                for p in batch]

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], str | None]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so chat is unavailable; use /v1/completions "
                                "with token ids", param="messages")
        extra = body.chat_template_kwargs or {}
        taken = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)} (the server sets "
                                f"them); leave them out", param="chat_template_kwargs")
        try:
            text = apply_chat_template(self.tokenizer, [m.as_template_input() for m in body.messages],
                                       add_generation_prompt=body.add_generation_prompt, **extra)
        except ValueError as exc:       # the messages, or a switch of chat_template_kwargs named first
            named = str(exc).split(" ", 1)[0] in extra
            raise APIError(400, str(exc), param="chat_template_kwargs" if named else "messages") from None
        # the template writes the BOS: special tokens only when the request asks (vLLM's default: none)
        return self._encode(text, "messages", special_tokens=body.add_special_tokens)

    def _encode(self, text: str, param: str, special_tokens: bool) -> tuple[list[int], str]:
        """Token ids of `text`: with `special_tokens` as a completion prompt (`Tokenizer.encode_prompt`),
        else as written."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer.json: send the prompt as token ids", param=param)
        text = checked_text(text, param)
        ids = self.tokenizer.encode_prompt(text) if special_tokens else self.tokenizer.encode(text)
        if not ids:
            raise APIError(400, f"{param} is empty (no tokens)", param=param)
        return ids, text

    def sampling_params(self, body: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int,
                        max_tokens: int | None, max_tokens_param: str = "max_tokens") -> SamplingParams:
        is_chat = isinstance(body, ChatCompletionRequest)
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(400, f"the prompt has {num_prompt_tokens} tokens; the model's context holds "
                                f"{self.max_model_len}, with room for at least one generated token",
                           param="messages" if is_chat else "prompt", code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(400, f"{max_tokens_param}={max_tokens} plus the prompt's {num_prompt_tokens} "
                                f"tokens exceeds the model's context of {self.max_model_len} tokens; ask "
                                f"for at most {room}", param=max_tokens_param, code="context_length_exceeded")
        if is_chat:
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            prompt_logprobs, best_of = None, None
        else:
            logprobs, best_of = body.logprobs, body.best_of
            prompt_logprobs = logprobs if body.echo and logprobs is not None else None
        # what the KV cache holds beside the prompt at the request's depth (more loops, more planes)
        most = self._kv_room(body, num_prompt_tokens)          # within `room`: max_request_len <= max_model_len
        if max_tokens is not None and max_tokens > most:
            raise APIError(400, f"{max_tokens_param}={max_tokens} plus the prompt's {num_prompt_tokens} tokens is "
                                f"more than the KV cache holds for one request at num_loops="
                                f"{self._num_loops(body)}; ask for at most {most} (or for fewer loops)",
                           param=max_tokens_param, code="context_length_exceeded")
        if max_tokens is None:       # vLLM's rule for chat: the rest of the context (a thinking model's
            # answer must not be cut at a fixed length); completions: the configured default
            max_tokens = most if is_chat else min(self.config.default_max_tokens, most)
            if (body.min_tokens or 0) > max_tokens:      # SamplingParams would blame a max_tokens not given
                fix = f", or set max_tokens (up to {most})" if most > max_tokens else ""
                raise APIError(400, f"min_tokens={body.min_tokens} is more than the {max_tokens} tokens this "
                                    f"request may generate without max_tokens; lower it{fix}", param="min_tokens")
        defaults = self.config.sampling.resolve(body.temperature, body.top_p, body.top_k, body.min_p,
                                                body.repetition_penalty)
        defaults["top_k"] = max(defaults["top_k"], 0)          # -1: off, as 0
        try:
            return SamplingParams(
                max_tokens=max_tokens, **defaults,
                seed=body.seed, n=body.n or 1, best_of=best_of,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                logit_bias={int(k): v for k, v in (body.logit_bias or {}).items()},
                min_tokens=body.min_tokens or 0, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                stop_token_ids=tuple(body.stop_token_ids or ()),
                stop=tuple(body.stop_strings()), include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                ignore_eos=body.ignore_eos, num_loops=body.num_loops or self.config.default_num_loops,
                exit_threshold=body.exit_threshold if body.exit_threshold is not None
                else self.config.default_exit_threshold)
        except ValueError as exc:            # SamplingParams names the field first ("top_k must be ...")
            field = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=field if field in type(body).model_fields else None) from None

    def _kv_room(self, body: CompletionRequest | ChatCompletionRequest, num_prompt_tokens: int) -> int:
        """The most tokens the request may generate: as many as the KV cache can hold beside its prompt
        at its depth; a 400 naming the depth where not even one fits."""
        num_loops = self._num_loops(body)
        longest = self.loop.engine.max_request_len(num_loops)
        if longest - num_prompt_tokens < 1:
            raise APIError(400, f"at num_loops={num_loops} the KV cache holds at most {longest} tokens of one "
                                f"request, not the prompt's {num_prompt_tokens} and one more: ask for fewer "
                                f"loops or send a shorter prompt", param="num_loops")
        return longest - num_prompt_tokens


    def _num_loops(self, body: CompletionRequest | ChatCompletionRequest) -> int:
        """The depth the request runs at: its own, else the server's default, else the engine's."""
        return body.num_loops or self.config.default_num_loops or self.loop.engine.default_num_loops


def _shortened(text: str, limit: int = 40) -> str:
    """`text` cut to `limit` characters for an error message (a client may send megabytes)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
