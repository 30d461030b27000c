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
once, so a finished request's text is exactly `decode(tokens)`, unless that does not extend the
text already reported: a byte-fallback decoder turns a run of byte tokens that held a whole
character into U+FFFDs when a stray byte joins it, so the window's decode stops extending the
emitted text. Then the text goes on after what was emitted (vLLM's rule) and the finished text is
the emitted text and the window's rest, so a stream and the finished answer agree.
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
        seen, window = self._window(token_ids)
        if len(window) > len(seen) and not window.endswith(INCOMPLETE):
            self.text += window[len(seen):]
            self.prefix_offset, self.read_offset = self.read_offset, num
        self.num_tokens = num
        return self.text

    def with_pending(self, token_ids: Sequence[int]) -> str:
        """`update(token_ids)` and, after it, the characters its last tokens have not completed yet
        (U+FFFD each, as a full decode shows them): where each token's text starts, even after a stray
        byte that never completes."""
        text = self.update(token_ids)
        seen, window = self._window(token_ids)
        return text + window[len(seen):]

    def finish(self, token_ids: Sequence[int]) -> str:
        """The text of the finished output: one full decode (kept for later calls) where it extends
        the text reported so far, else that text and the rest of the window."""
        if not (self.finished and self.num_tokens == len(token_ids)):
            full = self._decode(token_ids)
            if not full.startswith(self.text) and len(token_ids) >= self.num_tokens:
                seen, window = self._window(token_ids)
                full = self.text + window[len(seen):]
            self.text = full
            self.prefix_offset = self.read_offset = self.num_tokens = len(token_ids)
            self.finished = True
        return self.text

    def _window(self, token_ids: Sequence[int]) -> tuple[str, str]:
        """The decode of the emitted window and of the window with every token after it."""
        return (self._decode(token_ids[self.prefix_offset:self.read_offset]),
                self._decode(token_ids[self.prefix_offset:]))
