"""The OpenAI request bodies we accept (pydantic, strict types) and the OpenAI error object.

Fields follow the OpenAI API, plus the looped-model extras `num_loops` / `exit_threshold` and
vLLM's `top_k`, `min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`,
`include_stop_str_in_output`, `min_p`, `skip_special_tokens`, `chat_template_kwargs`,
`add_generation_prompt` (chat), `add_special_tokens` and `stream_options.continuous_usage_stats`.
Unknown fields are rejected (a typo such as `num_loop` must not be silently ignored); OpenAI fields we
do not implement (`suffix`, `tools`, `tool_choice`, `response_format`, `store`) are accepted only at
their neutral value, and `metadata` / `parallel_tool_calls` without effect.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20        # OpenAI's limit for logprobs / top_logprobs
MAX_N = 16               # samples per prompt (n, best_of)
# the roles OpenAI's chat API defines; anything else is most likely a client bug
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Body(BaseModel):
    # NaN and infinities (Python's JSON reads NaN, Infinity and 1e999) are refused by field name
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        # OpenAI's schema makes most fields nullable and its clients send null for "not set"
        # ("stream": null): a known field given null takes its default; unknown ones still fail
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False      # vLLM: the usage so far on every chunk


class _GenerationRequest(_Body):
    model: Optional[str] = None                         # None: the served model (vLLM's rule)
    # OpenAI fields that only tag or store a request elsewhere: accepted, without effect here
    metadata: Optional[dict[str, str]] = None
    store: Optional[bool] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)      # OpenAI caps it at 2; vLLM (and we) do not
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)           # -1 / 0: off
    min_p: Optional[float] = Field(None, ge=0, le=1)    # 0: off
    seed: Optional[int] = Field(None, ge=-MAX_SEED - 1, le=MAX_SEED)
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    n: Optional[int] = Field(None, ge=1, le=MAX_N)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    logit_bias: Optional[dict[str, float]] = None      # token id (as a string) -> bias in [-100, 100]
    # looped-model and vLLM extras
    repetition_penalty: Optional[float] = Field(None, gt=0)
    min_tokens: Optional[int] = Field(None, ge=0)
    num_loops: Optional[int] = Field(None, ge=1)
    exit_threshold: Optional[float] = Field(None, gt=0, le=1)
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_GenerationRequest):
    # a text, a batch of texts, token ids, or a batch of token ids: one choice each
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM extra: a text prompt gets the tokenizer's special tokens (e.g. a BOS) unless false
    add_special_tokens: bool = True


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # extra keys (name, tool_calls, ...) pass through to the chat template
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal[CHAT_ROLES]
    content: Union[str, list[TextPart], None] = None

    def as_template_input(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        message.setdefault("content", None)      # a null content (an assistant's call) stays a key
        return message                           # text parts: chat.check_messages joins them


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[Any]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None          # no tools: nothing to call in parallel
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # vLLM extras: the template's generation prompt (false: the model continues the last message's
    # turn as the template leaves it) and special tokens on the rendered text (the template writes them)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class TokenizeRequest(_Body):
    prompt: str
    add_special_tokens: bool = True          # as vLLM: the ids a completion of this prompt is fed
    model: Optional[str] = None


class DetokenizeRequest(_Body):
    tokens: list[int]
    model: Optional[str] = None


def unsupported_field(request: _GenerationRequest) -> str | None:
    """The first OpenAI field set to something this server does not implement, if any."""
    neutral = {"suffix": (None,), "tools": (None, []), "tool_choice": (None, "none", "auto"),
               "response_format": (None, {"type": "text"}), "store": (None, False)}
    for name, allowed in neutral.items():
        if name in type(request).model_fields and getattr(request, name) not in allowed:
            return name
    return None


def parse_request(cls: type[_Body], payload: Any) -> Any:
    """Validate a decoded JSON body; APIError 400 naming the first bad field."""
    if not isinstance(payload, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(payload).__name__}")
    try:
        return cls.model_validate(payload)
    except ValidationError as exc:
        problems: dict[str, list[str]] = {}            # where -> what, in order
        for error in exc.errors(include_url=False):
            where = ".".join(str(part) for part in error["loc"] if not _is_type_tag(part)) or "body"
            problems.setdefault(where, [])
            if error["msg"] not in problems[where]:
                problems[where].append(error["msg"])
        message = "; ".join(f"{where}: {' or '.join(msgs)}" for where, msgs in list(problems.items())[:3])
        raise APIError(400, message, param=next(iter(problems))) from None


def _is_type_tag(part: Any) -> bool:
    # pydantic names the member of a union it tried ("str", "list[int]"); the field path has none
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list") or "[" in part)
