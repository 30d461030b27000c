"""Stop strings: a sample ends where its decoded text first holds one of `params.stop`.

Why in the engine, not in the server: with `best_of > n` the engine ranks samples by their
log-probabilities, which must cover only the tokens the user gets; usage counts them; and
`LLM.generate` stops where the server does.

The rules (vLLM's): only text after the first `min_tokens` tokens is searched, though a stop string
may begin in the `len(stop) - 1` characters before it; each token's check searches the text it added
and that many characters before it; the earliest match wins. The answer's text ends before the stop
string, or after it with `include_stop_str_in_output`; the token that completed it stays in
`token_ids` and is counted. A sample that ends on a stop token reports its text without that
token's, unless `include_stop_str_in_output`.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from runtime.text.detokenizer import IncrementalDetokenizer


class StopMatch(NamedTuple):
    stop: str            # the stop string found (the output's `stop_reason`)
    text: str            # the answer's text: cut before it (after it with include_stop_str_in_output)


def detokenizer_of(request: Any, tokenizer: Any) -> IncrementalDetokenizer:
    """The request's incremental detokenizer for `tokenizer` (made on first use)."""
    detokenizer = request.detokenizer
    if detokenizer is None or detokenizer.tokenizer is not tokenizer:
        detokenizer = IncrementalDetokenizer(tokenizer, request.params.skip_special_tokens)
        request.detokenizer = detokenizer
    return detokenizer


def holdback_len(params: Any) -> int:
    """Characters at the end of a running sample's text that are not reported yet: the longest stop
    string's length less one, as they could be its start (none with `include_stop_str_in_output`,
    vLLM's rule). So every text reported while it runs is a prefix of its final text."""
    if not params.stop or params.include_stop_str_in_output:
        return 0
    return max(len(s) for s in params.stop) - 1


def check_stop_strings(request: Any, tokenizer: Any) -> StopMatch | None:
    """After a new output token of `request` (a `runtime.engine.sequence.Request`): the stop string
    its text now holds, if any. Call once per resolved token, in order."""
    params = request.params
    num_tokens = request.num_resolved_outputs
    detokenizer = detokenizer_of(request, tokenizer)
    searched = len(detokenizer.text)
    text = detokenizer.update(request.output_token_ids[:num_tokens])
    if num_tokens <= params.min_tokens:
        return None
    hits = [(i, stop) for stop in params.stop
            if (i := text.find(stop, max(0, searched - len(stop) + 1))) >= 0]
    if not hits:
        return None
    start, stop = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
    end = start + len(stop) if params.include_stop_str_in_output else start
    return StopMatch(stop, text[:end])
