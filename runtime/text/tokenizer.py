"""Text <-> token ids through the `tokenizers` library, from a checkpoint folder's tokenizer.json,
with the special tokens and chat template of tokenizer_config.json."""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

# tokenizer_config.json keys that name special tokens; chat templates see them as variables
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                      "mask_token")


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the special-token facts from
    tokenizer_config.json (and special_tokens_map.json, chat_template.jinja when present)."""

    def __init__(self, backend: Any, config: dict[str, Any] | None = None) -> None:
        self.backend = backend
        self.config = config or {}
        self._texts: dict[int, str] = {}      # token_text's answers: top-k lists repeat the same ids

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "Tokenizer | None":
        """The folder's tokenizer, or None when it has no tokenizer.json (token ids only)."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            return None
        from tokenizers import Tokenizer as Backend

        config = _read_json(folder / "tokenizer_config.json")
        for key, value in _read_json(folder / "special_tokens_map.json").items():
            config.setdefault(key, value)
        template_file = folder / "chat_template.jinja"
        if template_file.is_file():          # the file wins over the config's copy, as in transformers
            config["chat_template"] = template_file.read_text()
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:          # the tokenizers library raises its own Exception type
            raise ValueError(f"{path} cannot be read by the tokenizers library ({exc}): repair or replace "
                             f"it") from None
        return cls(backend, config)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def special_token(self, key: str) -> str | None:
        """The text of special token `key` ("eos_token", ...); the config stores a string or an
        AddedToken dict."""
        value = self.config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    @property
    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... -> text, for those the config names."""
        return {key: text for key in SPECIAL_TOKEN_KEYS if (text := self.special_token(key))}

    @property
    def eos_token_id(self) -> int | None:
        token = self.special_token("eos_token")
        return self.token_id(token) if token else None

    @property
    def bos_token_id(self) -> int | None:
        token = self.special_token("bos_token")
        return self.token_id(token) if token else None

    @property
    def chat_template(self) -> str | None:
        """The Jinja2 chat template; of a list of named ones, the one named "default" (a list without
        one is refused, as transformers refuses it, rather than guessing)."""
        return self.chat_template_for()

    def chat_template_for(self, tools: bool = False) -> str | None:
        """The chat template; with `tools`, a list's "tool_use" template where it has one (as in
        transformers), else its "default"."""
        template = self.config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if tools and named.get("tool_use"):
                return named["tool_use"]
            if "default" not in named:
                raise ValueError(f"tokenizer_config.json lists chat templates named {sorted(map(str, named))} "
                                 "and none named 'default': name the one to use 'default', or write it to "
                                 "chat_template.jinja beside tokenizer_config.json (that file takes precedence)")
            template = named["default"]
        return template or None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; without special tokens, as chat-template text is encoded (the template
        writes its own BOS) and as lm-eval encodes."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a plain-text prompt, as vLLM and transformers feed one: with the special
        tokens that tokenizer.json's post-processor adds (a Llama-style BOS, which the model was
        trained to see first; nothing for GPT-2-style tokenizers), less an end token it appends:
        a prompt is to be continued, and after the end token the model would start a new document
        (Huginn-0125's appends one; its model card cuts it with `[:, :-1]`). Only an end token the
        post-processor added goes (its special-tokens mask says which), never one the text holds."""
        encoding = self.backend.encode(text, add_special_tokens=True)
        ids = encoding.ids
        eos = self.eos_token_id
        if ids and eos is not None and ids[-1] == eos and encoding.special_tokens_mask[-1]:
            ids = ids[:-1]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text a token adds where it follows other text (logprobs' token names, vLLM's
        `decoded_token`). A SentencePiece-style decoder drops the leading space of a text's first
        word, so a token decoded alone ("▁world" -> "world") would lose the space it stands for;
        decoded after an anchor token whose text is then cut off, it keeps it (" world")."""
        text = self._texts.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
            if self._anchor is not None:
                prefix, anchor_id = self._anchor
                joined = self.decode([anchor_id, token_id], skip_special_tokens=False)
                if joined.startswith(prefix):
                    text = joined[len(prefix):]
            if len(self._texts) < 1 << 16:
                self._texts[token_id] = text
        return text

    @functools.cached_property
    def _anchor(self) -> tuple[str, int] | None:
        """(text, id) of a one-token text such as "a" that decodes to itself, or None."""
        for probe in ("a", "x", "0", "!"):
            ids = self.encode(probe)
            if len(ids) != 1:
                continue
            text = self.decode(ids, skip_special_tokens=False)
            if text and not text[0].isspace():
                return text, ids[0]
        return None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (the logprobs' `bytes`): a byte-fallback token's one byte, a
        byte-level BPE token's bytes (GPT-2's byte-to-character map undone), else the UTF-8 of its
        text (`token_text`, its leading space kept). Decoding a lone byte of a multi-byte character
        gives U+FFFD, so text cannot say it."""
        piece = self.backend.id_to_token(token_id) if self.backend is not None else None
        if piece is not None:
            byte = _BYTE_TOKEN.fullmatch(piece)
            if byte:
                return bytes([int(byte.group(1), 16)])
            if type(getattr(self.backend, "decoder", None)).__name__ == "ByteLevel":
                table = _bytes_of_chars()
                if all(ch in table for ch in piece):
                    return bytes(table[ch] for ch in piece)
        return self.token_text(token_id).encode("utf-8")


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=1)
def _bytes_of_chars() -> dict[str, int]:
    """Byte-level BPE's character -> byte: printable bytes stand for themselves, the others for
    characters from U+0100 on, in byte order (GPT-2's `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object file's settings ({} where the file is absent); ValueError naming the file."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}): repair or remove it") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must be a JSON object of settings, got a {type(value).__name__}")
    return value
