"""The text of a growing list of output tokens, decoded a few tokens at a time.

Why: a request's output is reported after every step. Decoding all of its tokens each time costs
O(length) per step, O(length^2) per request: at 64 requests of 4K tokens, milliseconds of host work
per step, more than the device's step. Here each step decodes a window of the last few tokens.

How (the usual streaming detokenizer): `prefix_offset <= read_offset <= len(tokens)`. The text of
`tokens[prefix_offset:read_offset]` was already emitted; decoding from `prefix_offset` (not from
`read_offset`) keeps the context a tokenizer needs to place spaces (SentencePiece-style decoders drop
the leading space of a decode's first token). The new text is `decode(tokens[prefix_offset:])`
minus `decode(tokens[prefix_offset:read_offset])`; while it ends in U+FFFD (a multi-byte character
cut between tokens) nothing is emitted and the window grows. `finish()` decodes the whole output
once, so a finished request's text is exactly `decode(tokens)`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""                  # the stable text of tokens[:read_offset]
        self.prefix_offset = 0
        self.read_offset = 0
        self.num_tokens = 0             # tokens seen by the last update
        self.finished = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def update(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids` (the whole output so far; it only grows), up to a character that
        its last tokens have not completed yet."""
        num = len(token_ids)
        if num < self.num_tokens or self.finished:    # not an extension of what was seen: start over
            self.__init__(self.tokenizer, self.skip_special_tokens)
        if num == self.num_tokens:
            return self.text
        seen = self._decode(token_ids[self.prefix_offset:self.read_offset])
        window = self._decode(token_ids[self.prefix_offset:num])
        if len(window) > len(seen) and not window.endswith(INCOMPLETE) and window.startswith(seen):
            self.text += window[len(seen):]
            self.prefix_offset, self.read_offset = self.read_offset, num
        self.num_tokens = num
        return self.text

    def finish(self, token_ids: Sequence[int]) -> str:
        """The exact text of the finished output (one full decode, kept for later calls)."""
        if not (self.finished and self.num_tokens == len(token_ids)):
            self.text = self._decode(token_ids)
            self.prefix_offset = self.read_offset = self.num_tokens = len(token_ids)
            self.finished = True
        return self.text
