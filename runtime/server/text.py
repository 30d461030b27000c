"""Cumulative decoded text -> the deltas a stream sends, with stop strings.

The engine reports a request's text after every step (decoded a window at a time while it runs,
in full once it finishes: runtime/text/detokenizer.py). Decoding a prefix of the tokens is not
always a prefix of the final text: a character split over several byte tokens decodes to
replacement characters ("\\ufffd") until its last byte arrives, and some decoders rewrite a run
of byte tokens when the next one lands. So a stream holds back a trailing "\\ufffd", sends only text
that extends what it already sent, and waits when the new text does not. Stop strings are held
back the same way: the last `len(stop) - 1` characters could be the start of one.
"""
from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class TextDelta(NamedTuple):
    text: str              # new text to send (may be empty)
    is_stopped: bool       # a stop string was found: the answer ends here (text excludes the stop string)


class TextStream:
    """Feed it each cumulative text; it returns what is safe to send."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = [s for s in stop if s]
        self.holdback_len = max((len(s) for s in self.stop), default=1) - 1
        self.sent = ""                 # everything sent so far
        self.text = ""                 # the answer so far: the latest text, cut at a stop string
        self.is_stopped = False

    def update(self, text: str, is_finished: bool, check_stop: bool = True) -> TextDelta:
        """`text` is the whole output decoded so far; `is_finished` says no token follows.
        `check_stop=False` (before min_tokens) lets stop strings pass."""
        if self.is_stopped:
            return TextDelta("", True)
        cut = self._find_stop(text) if check_stop else None
        if cut is not None:
            self.is_stopped, self.text = True, text[:cut]
            return TextDelta(self._extend(self.text), True)
        self.text = text
        if not is_finished:
            text = text.rstrip(REPLACEMENT)
            if self.holdback_len:
                text = text[:max(len(self.sent), len(text) - self.holdback_len)]
        return TextDelta(self._extend(text, is_final=is_finished), False)

    def _find_stop(self, text: str) -> int | None:
        # no stop string starts inside the text already sent: the held-back tail covered it
        hits = [i for i in (text.find(s, len(self.sent)) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _extend(self, text: str, is_final: bool = True) -> str:
        if not text.startswith(self.sent):
            if is_final:
                # the decoder rewrote text already sent; the stream cannot take it back
                log.warning("final text does not extend the streamed text (%r vs %r)", text, self.sent)
            return ""
        delta = text[len(self.sent):]
        self.sent = text
        return delta

