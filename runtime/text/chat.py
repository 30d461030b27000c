"""Chat templates: a checkpoint's Jinja2 `chat_template` rendered the way Hugging Face tokenizers
render it (sandboxed, `trim_blocks`/`lstrip_blocks`, `raise_exception`, `tojson`, the special tokens
as variables), plus the thinking opener for `-Thinking` checkpoints.

    text = apply_chat_template(tokenizer, [{"role": "user", "content": "Hi"}], enable_thinking=True)
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Mapping, NoReturn, Sequence

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from jinja2 import Template

    from runtime.text.tokenizer import Tokenizer

THINK_OPENER = "<think>"

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """The template could not be rendered for these messages (including its own raise_exception)."""


def raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # unlike Jinja2's built-in tojson: no HTML escaping, keyword arguments as json.dumps
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering
    keeps its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=16)
def compile_template(source: str) -> Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not compile: {exc}") from None


def check_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """A list of `{"role": ..., "content": ...}` dicts, or a ValueError that says what is wrong."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError('messages must be a non-empty list like [{"role": "user", "content": "Hi"}]')
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {message!r}")
        message = dict(message)
        content = message.get("content")
        if not isinstance(message["role"], str):
            raise ValueError(f"message {i}: role must be a string such as 'user', got {message['role']!r}")
        if "content" not in message and not message.get("tool_calls"):    # an assistant's tool call has none
            raise ValueError(f"message {i} has no 'content': give its text, e.g. {{'role': "
                             f"{message['role']!r}, 'content': 'Hi'}}")
        if content is None:        # an assistant's tool call: an empty text, as vLLM renders it (not "None")
            message["content"] = ""
        elif not isinstance(content, (str, Sequence)):
            raise ValueError(f"message {i}: content must be text or a list of text parts, got {content!r}")
        if isinstance(content, Sequence) and not isinstance(content, str):   # OpenAI content parts
            parts = [part for part in content if not (isinstance(part, Mapping) and part.get("type") == "text"
                                                      and isinstance(part.get("text"), str))]
            if parts:
                raise ValueError(f"message {i}: content parts must be text, like {{'type': 'text', 'text': "
                                 f"'Hi'}} (images and other inputs are not supported), got {parts[0]!r}")
            message["content"] = "\n".join(part["text"] for part in content)     # a line each, as vLLM joins them
        out.append(message)
    return out


def render_chat(template: str, messages: Sequence[Message], add_generation_prompt: bool = True,
                enable_thinking: bool | None = None, special_tokens: Mapping[str, str] | None = None,
                **extra: Any) -> str:
    """The template's text for `messages`. `special_tokens` (bos_token, eos_token, ...) and `extra`
    (tools, documents, any template-specific switch) become template variables; `enable_thinking`
    only when given (None: undefined, so the template's own default holds, as in transformers)."""
    # tools and documents are None unless given, as transformers passes them: a template's `tools is
    # not none` must not see an undefined value
    variables = {**(special_tokens or {}), "tools": None, "documents": None, **extra}
    if enable_thinking is not None:
        variables["enable_thinking"] = enable_thinking
    try:
        return compile_template(template).render(messages=check_messages(messages),
                                                 add_generation_prompt=add_generation_prompt, **variables)
    except ChatTemplateError:
        raise
    except (TemplateError, TypeError) as exc:     # TypeError: e.g. the template adds None to text
        raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None


# what the chat template call takes itself, which chat_template_kwargs (template variables) may not set
RESERVED_TEMPLATE_KWARGS = frozenset({"tokenizer", "messages", "add_generation_prompt", "template", "special_tokens",
                                      "chat_template", "continue_final_message"})


def apply_chat_template(tokenizer: Tokenizer, messages: Sequence[Message], add_generation_prompt: bool = True,
                        enable_thinking: bool | None = None, chat_template: str | None = None,
                        continue_final_message: bool = False, **extra: Any) -> str:
    """Render `messages` with the tokenizer's chat template (or `chat_template`, Jinja source).
    `enable_thinking` reaches the template only when given (None leaves the template's default). With
    `enable_thinking=True` and a generation prompt, the assistant turn starts with `<think>\\n` (added
    when the template does not add it itself): the -Thinking checkpoints do not open a thought block
    unprompted. `continue_final_message`: the text ends inside the last message, after its content,
    so the model continues that message (an assistant answer begun by the caller) instead of
    answering it, as in transformers and vLLM; it excludes a generation prompt."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message continues the last message, add_generation_prompt opens a "
                         "new one: set add_generation_prompt=False")
    template = chat_template
    if template is None:
        template = tokenizer.chat_template_for(tools=bool(extra.get("tools")))
    if template is None:
        raise ChatTemplateError("this checkpoint has no chat template (tokenizer_config.json 'chat_template' or "
                                "chat_template.jinja): format the prompt yourself (chat=false on the command "
                                "line, LLM.generate in Python), or give a template (LLM.chat(chat_template=...))")
    text = render_chat(template, messages, add_generation_prompt, enable_thinking, tokenizer.special_tokens,
                       **extra)
    if continue_final_message:
        text = _cut_after_final_message(text, template, messages, add_generation_prompt, enable_thinking,
                                        tokenizer.special_tokens, extra)
    if enable_thinking is True and add_generation_prompt and not text.rstrip().endswith(THINK_OPENER):
        if tokenizer.token_id(THINK_OPENER) is None:
            raise ValueError(f"enable_thinking needs a tokenizer with a {THINK_OPENER} token (a thinking "
                             f"checkpoint); this one has none")
        text += THINK_OPENER + "\n"
    return text


# stands in for the last message's content to find where the template writes it
_FINAL_MARK = "\x00final message\x00"


def _cut_after_final_message(text: str, template: str, messages: Sequence[Message], add_generation_prompt: bool,
                             enable_thinking: bool | None, special_tokens: Mapping[str, str],
                             extra: Mapping[str, Any]) -> str:
    """`text` up to the end of the last message's content, where the template closed the turn after it.
    The content is looked for from where the template writes it (a render with a mark in its place
    says where), so text such as "end" is not found inside the turn's closing `<|im_end|>`; where that
    fails (a template that rewrites the content) the content's last occurrence is taken."""
    checked = check_messages(messages)
    content = checked[-1]["content"].strip()
    start = -1
    if content:
        marked = [*checked[:-1], {**checked[-1], "content": _FINAL_MARK}]
        try:
            start = render_chat(template, marked, add_generation_prompt, enable_thinking, special_tokens,
                                **extra).find(_FINAL_MARK)
        except ChatTemplateError:          # the template inspects the content: look for it from the end
            pass
    end = text.find(content, start) if start >= 0 else -1
    if end < 0 and content:                # the template wrote other text before it than with the mark
        end = text.rfind(content)
    if end < 0:
        raise ValueError("continue_final_message: the last message's content is empty or does not appear in the "
                         "text the chat template made of it, so there is no place to continue from")
    return text[:end + len(content)]
