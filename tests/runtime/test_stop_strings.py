"""Stop strings and stop tokens end a sample inside the engine (runtime/engine/stop_strings.py), by
vLLM's rules: the text ends before the stop string or token (after it with
include_stop_str_in_output), the token that completed it is the last of `token_ids`, only text after
`min_tokens` tokens counts, best_of ranks samples that already stopped, and async scheduling and
speculation stop where the plain engine does. The packaged ouro-tiny and its tokenizer, greedy."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import zoo
from hal.cpu import CpuHal
from helpers import single_thread  # noqa: F401 (fixture)
from runtime import LLM, SamplingParams
from runtime.config import EngineConfig, SpeculativeConfig
from runtime.engine.llm_engine import LLMEngine

PACKAGED = Path(zoo.__file__).parent / "checkpoints" / "ouro-tiny"
PROMPT = "In the beginning"
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(PACKAGED, hal="cpu", dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def plain(llm):
    out = llm.generate([PROMPT], GREEDY)[0]
    assert len(out.token_ids) == 24 and len(out.text) > 16
    return out


def _run(llm, **params):
    return llm.generate([PROMPT], dataclasses.replace(GREEDY, **params))[0]


def _decode(llm, ids):
    return llm.tokenizer.decode(ids)


def test_a_stop_string_cuts_the_text_and_ends_the_tokens(llm, plain):
    stop = plain.text[8:12]
    start = plain.text.index(stop)
    out = _run(llm, stop=["never in this text", stop])
    assert out.text == plain.text[:start] and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == stop
    assert out.token_ids == plain.token_ids[:len(out.token_ids)]
    assert stop in _decode(llm, out.token_ids) and stop not in _decode(llm, out.token_ids[:-1])
    kept = _run(llm, stop=stop, include_stop_str_in_output=True)
    assert kept.text == plain.text[:start + len(stop)] and kept.token_ids == out.token_ids


def test_a_stop_string_on_the_last_allowed_token_still_stops(llm, plain):
    stop = plain.text[8:12]
    first = _run(llm, stop=stop)
    out = _run(llm, stop=stop, max_tokens=len(first.token_ids))
    assert (out.text, out.token_ids, out.finish_reason) == (first.text, first.token_ids, "stop")


def test_a_stream_holds_back_what_could_start_a_stop_string(llm, plain):
    """Every text `LLM.stream` yields while the sample runs is a prefix of its final text: the last
    `len(stop) - 1` characters wait, as they could begin the stop string (vLLM's rule; before, a
    stream yielded the first word of a two-word stop string and took it back at the end)."""
    words = plain.text.split(" ")
    stop = next(" ".join(words[i:i + 2]) for i in range(len(words) // 2, len(words) - 1) if len(words[i]) > 1)
    params = dataclasses.replace(GREEDY, stop=["longer than any stop string", stop])
    texts = [o.text for o in llm.stream(PROMPT, params)]
    assert texts[-1] == plain.text[:plain.text.index(stop)] and len(texts) > 4
    assert all(texts[-1].startswith(t) for t in texts)
    assert len(texts[-2]) == max(len(_decode(llm, plain.token_ids[:len(texts) - 1])) - 26, 0)
    kept = [o.text for o in llm.stream(PROMPT, dataclasses.replace(params, include_stop_str_in_output=True))]
    assert kept[-1].endswith(stop) and all(kept[-1].startswith(t) for t in kept)
    assert kept[-2] == _decode(llm, plain.token_ids[:len(kept) - 1])     # nothing to hold back there


def test_only_text_after_min_tokens_is_searched(llm, plain):
    stop = plain.text[8:12]
    first = _run(llm, stop=stop)
    k = len(first.token_ids)                     # the token that completed the first match
    out = _run(llm, stop=stop, min_tokens=k)
    searched_from = max(0, len(_decode(llm, plain.token_ids[:k])) - len(stop) + 1)
    hit = plain.text.find(stop, searched_from)
    assert len(out.token_ids) > k
    assert out.text == (plain.text[:hit] if hit >= 0 else plain.text)


def test_a_stop_token_ends_the_sample_without_its_text(llm, plain):
    token = plain.token_ids[5]
    j = plain.token_ids.index(token)
    out = _run(llm, stop_token_ids=[token])
    assert out.token_ids == plain.token_ids[:j + 1] and out.finish_reason == "stop"
    assert out.text == _decode(llm, plain.token_ids[:j]) and out.outputs[0].stop_reason == token
    kept = _run(llm, stop_token_ids=[token], include_stop_str_in_output=True)
    assert kept.text == _decode(llm, plain.token_ids[:j + 1])


def test_only_the_tokenizers_end_token_leaves_stop_reason_none(llm, plain):
    """vLLM's rule: an end token of the model's other than the tokenizer's EOS (vLLM takes them from
    generation_config; here LLM(stop_token_ids=), the engine's defaults) names itself in stop_reason,
    as a request's own stop token does; the tokenizer's EOS ends with None, also where the request
    lists it among its own stop tokens (vLLM checks EOS first)."""
    token = plain.token_ids[5]
    j = plain.token_ids.index(token)
    ended = LLM(PACKAGED, hal="cpu", dtype="float32", num_kv_blocks=256, stop_token_ids=[token])
    out = ended.generate([PROMPT], dataclasses.replace(GREEDY, ignore_eos=False))[0]
    assert out.token_ids == plain.token_ids[:j + 1] and out.finish_reason == "stop"
    assert out.outputs[0].stop_reason == token

    tokenizer = type(llm.tokenizer)(llm.tokenizer.backend, dict(llm.tokenizer.config))
    tokenizer.config["eos_token"] = tokenizer.backend.id_to_token(token)
    assert tokenizer.eos_token_id == token
    engine = LLMEngine(llm.engine.model, CpuHal(), EngineConfig(num_kv_blocks=256), tokenizer)
    prompt = llm.tokenizer.encode_prompt(PROMPT)
    for params in (dataclasses.replace(GREEDY, ignore_eos=False),
                   dataclasses.replace(GREEDY, ignore_eos=False, stop_token_ids=[token])):
        engine.add_request("eos", prompt, params)
        out = next(o for o in engine.run_until_done() if o.request_id == "eos")
        assert out.token_ids == plain.token_ids[:j + 1] and out.finish_reason == "stop"
        assert out.outputs[0].stop_reason is None
    # ignoring EOS, the request's own stop token of the same id names itself (vLLM skips its EOS check)
    engine.add_request("own", prompt, dataclasses.replace(GREEDY, stop_token_ids=[token]))
    out = next(o for o in engine.run_until_done() if o.request_id == "own")
    assert out.token_ids == plain.token_ids[:j + 1] and out.outputs[0].stop_reason == token


@pytest.mark.parametrize("option", ["async", "speculation"])
def test_async_scheduling_and_speculation_stop_where_the_plain_engine_does(plain, option, single_thread):
    stop = plain.text[8:12]
    config = dict(async_scheduling=True) if option == "async" else dict(speculative=SpeculativeConfig(3, 2))
    llm = LLM(PACKAGED, hal="cpu", dtype="float32", num_kv_blocks=256, **config)
    params = dataclasses.replace(GREEDY, stop=stop)
    reference = LLM(PACKAGED, hal="cpu", dtype="float32", num_kv_blocks=256).generate([PROMPT], params)[0]
    out = llm.generate([PROMPT], params)[0]
    assert (out.text, out.token_ids, out.finish_reason) == (reference.text, reference.token_ids, "stop")
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks


def test_best_of_ranks_samples_that_already_stopped(llm):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True, stop=[" ", "e"])
    best = llm.generate([PROMPT], dataclasses.replace(params, n=1, best_of=4, logprobs=0))[0]
    for sample in best.outputs:
        assert " " not in sample.text and "e" not in sample.text
        assert len(sample.logprobs) == len(sample.token_ids)
        if sample.finish_reason == "stop":
            assert not {" ", "e"} & set(_decode(llm, sample.token_ids[:-1]))


def test_stop_strings_need_a_tokenizer():
    model = zoo.from_pretrained(PACKAGED, dtype="float32")
    engine = LLMEngine(model, CpuHal(), EngineConfig(num_kv_blocks=64))
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        engine.add_request("a", [1, 2, 3], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="stop takes non-empty strings"):
        SamplingParams(stop=["x", ""])
    assert SamplingParams(stop="x").stop == ("x",)


def test_stop_token_ids_outside_the_vocabulary_are_refused_at_start():
    """model.stop_token_ids past the vocabulary could never end an answer (a request's own are refused
    the same way)."""
    model = zoo.from_pretrained(PACKAGED, dtype="float32")
    vocab = model.config.vocab_size
    with pytest.raises(ValueError, match=f"outside the model's vocabulary of {vocab}.*model.stop_token_ids"):
        LLMEngine(model, CpuHal(), EngineConfig(num_kv_blocks=64), extra_stop_token_ids=[vocab + 5])
    LLMEngine(model, CpuHal(), EngineConfig(num_kv_blocks=64), extra_stop_token_ids=[vocab - 1])


def test_an_abort_reports_the_text_held_back_for_a_stop_string(llm):
    """An abort's output is the request's last: the characters held back while it ran (they could
    have started a stop string) are in it (found by a review; the server's shutdown reports this)."""
    engine = LLMEngine(llm.engine.model, CpuHal(), EngineConfig(num_kv_blocks=256), llm.tokenizer)
    engine.add_request("a", llm.tokenizer.encode_prompt(PROMPT),
                       dataclasses.replace(GREEDY, stop=["never in this text at all"]))
    running = [engine.step() for _ in range(8)][-1][0]
    out = engine.output_for("a", "abort")
    assert out.finished and out.text == _decode(llm, out.token_ids) and len(out.text) > len(running.text)
