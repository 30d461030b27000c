"""The official `openai` client against a live server on the golden tiny Ouro: completions and chat,
streamed and not, give the engine's own greedy output, with correct usage and finish_reason."""
from __future__ import annotations

import re

import pytest

SERVE_EXTRA = "needs the serve extra: pip install -e '.[serve]'"
httpx = pytest.importorskip("httpx", reason=SERVE_EXTRA)
pytest.importorskip("fastapi", reason=SERVE_EXTRA)
openai = pytest.importorskip("openai", reason=SERVE_EXTRA)

from runtime import LLM, SamplingParams
from runtime.text.chat import apply_chat_template

PROMPTS = ["the cat sat on", "hello, how are you?", "loops make a small model"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference(tiny_model, tokenizer):
    """The engine's own answer (LLM.generate), computed while the server is idle."""
    llm = LLM(tiny_model, hal="cpu", tokenizer=tokenizer, num_kv_blocks=128)

    def generate(prompt, **params):
        params = {"max_tokens": MAX_TOKENS, "temperature": 0.0, **params}
        return llm.generate(prompt, SamplingParams(**params))[0]
    return generate


def streamed(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    """Text and finish_reason per choice index, and the usage of the last chunk."""
    texts, reasons, usage = {}, {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        usage = chunk.usage or usage
    return texts, reasons, usage


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_streamed_and_not_equal_the_engine(client, reference, prompt):
    ref = reference(prompt)
    assert ref.token_ids, "the reference generated nothing: a useless test prompt"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == len(ref.prompt_token_ids) + len(ref.token_ids)

    texts, reasons, usage = streamed(client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert texts == {0: ref.text} and reasons == {0: ref.finish_reason}
    assert usage.model_dump() == out.usage.model_dump()


def test_both_finish_reasons_are_covered(reference):
    reasons = {reference(p).finish_reason for p in PROMPTS}
    assert reasons == {"stop", "length"}           # <|im_end|> ends "hello, ..." early


def test_chat_streamed_and_not_equal_the_engine_on_the_rendered_template(client, reference, tokenizer):
    messages = [{"role": "system", "content": "be brief."},
                {"role": "user", "content": "what is the capital of france?"}]
    prompt = apply_chat_template(tokenizer, messages)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tokenizer.encode(prompt).count(tokenizer.token_id("<|im_start|>")) == 3   # special tokens matched
    ref = reference(prompt)
    assert ref.token_ids
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    texts, reasons, usage = streamed(chunks)
    assert texts == {0: ref.text} and reasons == {0: ref.finish_reason}
    assert usage.completion_tokens == len(ref.token_ids)


def test_text_parts_and_max_completion_tokens(client, reference, tokenizer):
    parts = [{"type": "text", "text": "the cat"}, {"type": "text", "text": "sat"}]    # a line each (vLLM)
    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": "the cat\nsat"}])
    ref = reference(prompt, max_tokens=5)
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                         max_completion_tokens=5, temperature=0)
    assert out.choices[0].message.content == ref.text and out.usage.completion_tokens == len(ref.token_ids)


def test_a_batch_of_prompts_gives_one_choice_each(client, reference):
    refs = [reference(p) for p in PROMPTS]
    out = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [r.text for r in refs]
    assert out.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    texts, reasons, _ = streamed(client.completions.create(model="tiny", prompt=PROMPTS,
                                                           max_tokens=MAX_TOKENS, temperature=0, stream=True))
    assert texts == {i: r.text for i, r in enumerate(refs)}
    assert reasons == {i: r.finish_reason for i, r in enumerate(refs)}


def test_token_id_prompt_and_stop_string(client, reference):
    ids = [50, 42, 53, 42, 52, 24, 17]
    ref = reference(ids, max_tokens=16, ignore_eos=True)
    text = ref.text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    expected = text[:text.index(stop)]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0,
                                    stop=[stop, "zzzz"], extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 16
    texts, reasons, _ = streamed(client.completions.create(model="tiny", prompt=ids, max_tokens=16,
                                                           temperature=0, stop=stop, stream=True,
                                                           extra_body={"ignore_eos": True}))
    assert texts == {0: expected} and reasons == {0: "stop"}


def test_num_loops_exit_threshold_seed_and_top_k_reach_the_engine(client, reference, server):
    prompt = PROMPTS[0]
    ref = reference(prompt, num_loops=2)
    assert ref.token_ids != reference(prompt).token_ids        # the depth changes this prompt's answer
    loops_before = _metric(server, "loopstack_loops_per_token_sum")
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"num_loops": 2, "exit_threshold": 1.0})
    assert out.choices[0].text == ref.text
    assert _metric(server, "loopstack_loops_per_token_sum") - loops_before == 2 * out.usage.completion_tokens

    sampled = reference(prompt, temperature=1.0, seed=7)
    for _ in range(2):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0,
                                        seed=7)
        assert out.choices[0].text == sampled.text
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=1.0,
                                    seed=3, extra_body={"top_k": 1})
    assert out.choices[0].text == reference(prompt).text         # top_k=1 is greedy


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("loopstack_requests_total", "loopstack_prompt_tokens_total",
                 "loopstack_generation_tokens_total", "loopstack_requests_waiting",
                 "loopstack_requests_running", "loopstack_kv_blocks_free",
                 "loopstack_time_to_first_token_seconds_bucket",
                 "loopstack_inter_token_latency_seconds_bucket",
                 "loopstack_loops_per_token_bucket", "loopstack_e2e_request_latency_seconds_count"):
        assert name in text, name
    assert _metric(server, "loopstack_kv_blocks_free") == _metric(server, "loopstack_kv_blocks")
    assert _metric(server, 'loopstack_requests_total{finish_reason="length"}') >= 1
    finished = sum(_metric(server, f'loopstack_requests_total{{finish_reason="{r}"}}')
                   for r in ("stop", "length", "abort"))
    assert _metric(server, "loopstack_time_to_first_token_seconds_count") == finished   # one first token each


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0
