"""Incremental detokenization (runtime/text/detokenizer.py): the text a running request reports is
a prefix of the full decode, a finished request's text is exactly the full decode, and the work per
step stays bounded instead of growing with the output."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

import zoo
from hal.cpu import CpuHal
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.text.detokenizer import IncrementalDetokenizer
from runtime.text.tokenizer import Tokenizer

PACKAGED = Path(zoo.__file__).parent / "checkpoints" / "ouro-tiny"
TEXT = ("In the beginning God created the heaven and the earth. ¿Qué tal? Grüße aus Köln — 東京タワー, "
        "naïve café 🙂🚀 x² ≤ ∞. git commit --amend; printf(\"%d\\n\", x);  two  spaces\ttab\n")


class Counting:
    """A tokenizer that counts the tokens it decodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def _packaged() -> Tokenizer:
    tokenizer = Tokenizer.from_folder(PACKAGED)
    assert tokenizer is not None
    return tokenizer


def _metaspace() -> Tokenizer:
    """A SentencePiece-style tokenizer (Metaspace: a decode drops its first token's leading space)."""
    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    return Tokenizer(hf)


def _check_stream(tokenizer, ids: list[int]) -> None:
    counting = Counting(tokenizer)
    detok = IncrementalDetokenizer(counting)
    for i in range(1, len(ids) + 1):
        text = detok.update(ids[:i])
        full = tokenizer.decode(ids[:i])
        assert full.startswith(text), (i, text, full)
        # held back: only characters the last tokens have not completed
        assert len(full) - len(text) <= 4 * (detok.num_tokens - detok.read_offset + 1) + 4
    assert counting.decoded <= 2 * 12 * len(ids), "each step decodes a bounded window"
    assert detok.finish(ids) == tokenizer.decode(ids)


@pytest.mark.parametrize("make", [_packaged, _metaspace], ids=["byte-bpe", "metaspace"])
def test_streamed_text_is_a_prefix_and_the_finished_text_is_exact(make):
    tokenizer = make()
    ids = tokenizer.encode(TEXT)
    _check_stream(tokenizer, ids)
    rng = random.Random(0)                   # arbitrary ids: bytes that never complete a character
    _check_stream(tokenizer, [rng.randrange(tokenizer.vocab_size) for _ in range(200)])


def test_a_shorter_list_starts_over():
    tokenizer = _packaged()
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer)
    detok.update(ids[:30])
    assert tokenizer.decode(ids[:10]).startswith(detok.update(ids[:10]))
    assert detok.finish(ids) == tokenizer.decode(ids) and detok.finish(ids) == tokenizer.decode(ids)


def test_engine_reports_text_without_decoding_everything_each_step():
    """A 40-token generation reported after every step decodes O(length) tokens in all, not
    O(length^2), and its final text is the full decode of its tokens."""
    tokenizer = _packaged()
    counting = Counting(tokenizer)
    model = zoo.from_pretrained(PACKAGED, dtype="float32")
    engine = LLMEngine(model, CpuHal(), EngineConfig(max_num_seqs=2, num_kv_blocks=64), tokenizer=counting)
    engine.add_request("a", tokenizer.encode("In the beginning"), SamplingParams(max_tokens=40, temperature=0.0,
                                                                              ignore_eos=True))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    texts, final = [o.text for o in outputs], outputs[-1]
    assert final.finished and len(final.token_ids) == 40 and len(texts) >= 40
    assert final.text == tokenizer.decode(final.token_ids)
    assert all(final.text.startswith(t) for t in texts[:-1])
    assert counting.decoded <= 6 * 40 + 40, counting.decoded      # full decodes every step: 820


@pytest.mark.parametrize("make", [_packaged, _metaspace], ids=["byte-bpe", "metaspace"])
def test_token_texts_keep_the_spaces_a_lone_decode_drops(make):
    """Logprobs name each token by the text it adds after other text (`Tokenizer.token_text`): a
    SentencePiece-style decode of "▁world" alone says "world", after other text " world". The names
    (and `token_bytes`) of a text's tokens put together give the text back."""
    tokenizer = make()
    text = "In the beginning God created the heaven and the earth."
    ids = tokenizer.encode(text)
    names = [tokenizer.token_text(i) for i in ids]
    assert "".join(names).removeprefix(" ") == tokenizer.decode(ids) == text
    assert b"".join(tokenizer.token_bytes(i) for i in ids).decode().removeprefix(" ") == text
    assert any(name.startswith(" ") for name in names[1:])
    if make is _packaged:                       # byte-level BPE: a lone decode already keeps the space
        assert names == [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    else:
        assert any(n != tokenizer.decode([i]) for n, i in zip(names, ids))
