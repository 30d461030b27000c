"""What generation returns."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None                   # the prompt text when one was given
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None     # "stop" (a stop token) | "length" (max_tokens / context) | "abort"
    loops_per_token: list[int] = field(default_factory=list)   # loops each generated token ran
    metrics: Any = None                  # runtime.engine.sequence.RequestMetrics (times, preemptions)
    error: str | None = None             # why the request was rejected (finish_reason "error")
