"""Chat messages -> prompt text with the checkpoint's `chat_template` (tokenizer_config.json),
rendered by Jinja2 in a sandbox the way Hugging Face tokenizers render it.

A stand-in until `runtime.chat` lands: it has the same call shape,
`apply_chat_template(tokenizer, messages, add_generation_prompt=True, **template_kwargs)`, so the
server switches by changing one import in `runtime/server/generation.py`.
"""
from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Mapping, NoReturn, Sequence

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from jinja2 import Template

    from runtime.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """The template is missing, does not compile, or refused these messages."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            sort_keys: bool = False) -> str:
    # templates expect json.dumps output, not Jinja2's HTML-escaped tojson
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(source: str) -> "Template":
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"the checkpoint's chat template does not compile: {exc}") from None


def template_source(tokenizer: "Tokenizer") -> str | None:
    """The default chat template of the tokenizer's config, if it has one."""
    template = tokenizer.config.get("chat_template")
    if isinstance(template, list):              # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _special_tokens(tokenizer: "Tokenizer") -> dict[str, str]:
    tokens = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = tokenizer.config.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[key] = value
    return tokens


def apply_chat_template(tokenizer: "Tokenizer", messages: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
    """The prompt text for `messages` (dicts with "role" and "content"). `template_kwargs` become
    template variables (e.g. `enable_thinking`). Raises ChatTemplateError (a ValueError)."""
    source = template_source(tokenizer)
    if source is None:
        raise ChatTemplateError("this model has no chat template (tokenizer_config.json 'chat_template'); "
                                "use /v1/completions with a formatted prompt")
    variables = {**_special_tokens(tokenizer), **template_kwargs}
    try:
        return _compile(source).render(messages=[dict(m) for m in messages],
                                       add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except (TemplateError, TypeError, ValueError) as exc:
        raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None
