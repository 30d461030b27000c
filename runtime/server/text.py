"""Cumulative decoded text -> the deltas a stream sends, with stop strings.

The engine reports a request's text after every step (decoded a window at a time while it runs,
in full once it finishes: runtime/text/detokenizer.py). Decoding a prefix of the tokens is not
always a prefix of the final text: a character split over several byte tokens decodes to
replacement characters ("\\ufffd") until its last byte arrives, and some decoders rewrite a run
of byte tokens when the next one lands. So a stream holds back a trailing "\\ufffd", sends only text
that extends what it already sent, and waits when the new text does not. Text that could start a
stop string the engine holds back itself (`runtime.engine.stop_strings.holdback_len`).
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class TextStream:
    """Feed it each cumulative text; it returns what is safe to send. The engine ends a sample at a
    stop string and reports its text cut there (runtime/engine/stop_strings.py)."""

    def __init__(self) -> None:
        self.sent = ""                 # everything sent so far
        self.text = ""                 # the answer so far (the latest text)

    def update(self, text: str, is_finished: bool) -> str:
        """`text` is the whole output decoded so far; `is_finished` says no token follows."""
        self.text = text
        if not is_finished:
            text = text.rstrip(REPLACEMENT)
        return self._extend(text, is_final=is_finished)

    def _extend(self, text: str, is_final: bool = True) -> str:
        if not text.startswith(self.sent):
            if is_final:
                # the decoder rewrote text already sent; the stream cannot take it back
                log.warning("final text does not extend the streamed text (%r vs %r)", text, self.sent)
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta

