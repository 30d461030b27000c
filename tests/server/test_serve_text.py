"""Stream deltas from cumulative decodes (split characters held back; the engine holds back what could
start a stop string), and the chat template rendered in a sandbox."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from live_server import CHAT_TEMPLATE
from runtime.text.chat import ChatTemplateError, apply_chat_template
from runtime.server.text import REPLACEMENT, TextStream
from runtime.text.detokenizer import IncrementalDetokenizer
from runtime.text.tokenizer import Tokenizer


def stream_ids(tokenizer, ids) -> tuple[list[str], TextStream]:
    """Feed the decodes of each prefix of `ids`, as the engine produces them; the deltas sent."""
    stream = TextStream()
    deltas = [stream.update(tokenizer.decode(ids[:n]), is_finished=n == len(ids)) for n in range(1, len(ids) + 1)]
    return deltas, stream


def test_a_character_split_over_byte_tokens_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("the €, é")
    euro = [tokenizer.token_id(t) for t in ("<0xE2>", "<0x82>", "<0xAC>")]
    start = next(i for i in range(len(ids)) if ids[i:i + 3] == euro)
    deltas, _ = stream_ids(tokenizer, ids)
    assert deltas[start] == deltas[start + 1] == ""                  # € incomplete: nothing sent
    assert deltas[start + 2].endswith("€")
    assert not any(REPLACEMENT in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == "the €, é"


def test_a_decoder_rewriting_earlier_text_is_waited_out(tokenizer):
    # byte fallback decodes E2 82 AC C3 as four replacement characters: "€" vanishes until A9 lands
    ids = [tokenizer.token_id(t) for t in ("<0xE2>", "<0x82>", "<0xAC>", "<0xC3>", "<0xA9>")]
    assert tokenizer.decode(ids[:4]) == REPLACEMENT * 4
    deltas, _ = stream_ids(tokenizer, ids)
    assert deltas == ["", "", "€", "", "é"]


def test_a_stray_byte_after_a_character_does_not_end_the_stream(tokenizer):
    """Byte fallback decodes C3 AC as "ì", then C3 AC 9F as three replacement characters: the text
    already sent stops being a prefix of the decode. The rest of the answer is still sent, and the
    finished text is what the stream sent (vLLM's rule), not a full decode that would contradict it."""
    ids = [tokenizer.token_id(t) for t in ("<0xC3>", "<0xAC>", "<0x9F>")] + tokenizer.encode(" the cat sat")
    assert not tokenizer.decode(ids).startswith("ì")
    detokenizer, stream = IncrementalDetokenizer(tokenizer), TextStream()
    texts = [detokenizer.update(ids[:n]) for n in range(1, len(ids))] + [detokenizer.finish(ids)]
    sent = "".join(stream.update(text, is_finished=n == len(ids)) for n, text in enumerate(texts, 1))
    assert sent == texts[-1] and sent.startswith("ì") and sent.endswith(" the cat sat")


def test_finishing_flushes_what_was_held_back():
    stream = TextStream()
    assert stream.update("ab" + REPLACEMENT, is_finished=False) == "ab"
    assert stream.update("ab" + REPLACEMENT, is_finished=True) == REPLACEMENT
    assert stream.text == "ab" + REPLACEMENT


@settings(max_examples=40, deadline=None)
@given(words=st.lists(st.sampled_from(["the", " cat", " €", "é", ",", " paris", "!", " 😀"]),
                      min_size=1, max_size=12))
def test_deltas_add_up_to_the_text(tokenizer, words):
    text = "".join(words)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    deltas, stream = stream_ids(tokenizer, ids)
    assert not any(REPLACEMENT in d for d in deltas)
    assert "".join(deltas) == stream.text == text


def chat_tokenizer(template) -> Tokenizer:
    return Tokenizer(backend=None, config={"chat_template": template, "eos_token": {"content": "<|im_end|>"}})


def test_chat_template_renders_messages_and_the_generation_prompt():
    tokenizer = chat_tokenizer(CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi"}]
    assert apply_chat_template(tokenizer, messages) == \
        "<|im_start|>system\nbe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert apply_chat_template(tokenizer, messages, add_generation_prompt=False).endswith("hi<|im_end|>\n")


def test_chat_template_variables_and_named_templates():
    source = "{{ eos_token }}|{{ enable_thinking }}|{{ messages | length }}|{{ messages[0] | tojson }}"
    tokenizer = chat_tokenizer([{"name": "tool_use", "template": "x"},
                                {"name": "default", "template": source}])
    text = apply_chat_template(tokenizer, [{"role": "user", "content": "é"}])
    assert text == '<|im_end|>||1|{"role": "user", "content": "é"}'        # enable_thinking undefined
    text = apply_chat_template(tokenizer, [{"role": "user", "content": "é"}], enable_thinking=False)
    assert text == '<|im_end|>|False|1|{"role": "user", "content": "é"}'


@pytest.mark.parametrize("template,message", [
    (None, "no chat template"),
    ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}"
     "{% endif %}", "first message must be from the user"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "failed"),            # the sandbox refuses
    ("{% for %}", "does not compile"),
])
def test_chat_template_errors_are_value_errors(template, message):
    with pytest.raises(ChatTemplateError, match=message):
        apply_chat_template(chat_tokenizer(template), [{"role": "system", "content": "x"}])
