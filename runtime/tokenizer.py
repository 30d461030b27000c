"""Text <-> token ids through the `tokenizers` library, from a checkpoint folder's tokenizer.json."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the special-token facts from
    tokenizer_config.json (eos, added tokens)."""

    def __init__(self, backend: Any, config: dict[str, Any] | None = None) -> None:
        self.backend = backend
        self.config = config or {}

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "Tokenizer | None":
        """The folder's tokenizer, or None when it has no tokenizer.json (token ids only)."""
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            return None
        from tokenizers import Tokenizer as Backend

        config_path = Path(folder) / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls(Backend.from_file(str(path)), config)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _special(self, key: str) -> str | None:
        value = self.config.get(key)
        return value.get("content") if isinstance(value, dict) else value

    @property
    def eos_token_id(self) -> int | None:
        token = self._special("eos_token")
        return self.token_id(token) if token else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
