"""The OpenAI client against a live server: logprobs on completions (with and without echo, streamed
and not) and chat, n samples, penalties and logit_bias, the model's sampling defaults (the same greedy
text as runtime.generate), the tokenizer endpoints, and a tokenizer's special tokens on completion
prompts (not on chat prompts, whose template writes them)."""
from __future__ import annotations

import pytest

SERVE_EXTRA = "needs the serve extra: pip install -e '.[serve]'"
httpx = pytest.importorskip("httpx", reason=SERVE_EXTRA)
pytest.importorskip("fastapi", reason=SERVE_EXTRA)
openai = pytest.importorskip("openai", reason=SERVE_EXTRA)
from hydra import compose, initialize_config_dir

import hal
from live_server import CHAT_TEMPLATE, LiveServer
from runtime import LLM, SamplingParams
from runtime.cli import CONF_DIR
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingDefaults
from runtime.engine.llm_engine import LLMEngine
from runtime.server.app import build_app
from runtime.server.config import ServerConfig
from runtime.text.tokenizer import Tokenizer

PROMPT = "the cat sat on"


@pytest.fixture(scope="module")
def offline(tiny_model, tokenizer):
    llm = LLM(tiny_model, hal="cpu", tokenizer=tokenizer, num_kv_blocks=128)
    return lambda prompt, **params: llm.generate(prompt, SamplingParams(**params))[0]


def test_completion_logprobs_equal_the_offline_ones(client, offline, tokenizer):
    ref = offline(PROMPT, max_tokens=6, temperature=0, logprobs=2, ignore_eos=True)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-4)
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(v, abs=1e-6)   # greedy: the top token
               for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == out.choices[0].text and lp.text_offset[0] == 0
    sampled = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=2.0, seed=7,
                                        logprobs=1, extra_body={"ignore_eos": True}).choices[0].logprobs
    ref = offline(PROMPT, max_tokens=12, temperature=2.0, seed=7, logprobs=1, ignore_eos=True).logprobs
    assert any(lp.rank > 1 for lp in ref)           # the chosen token joins the top 1, as in vLLM
    want = [{_completion_name(tokenizer, t): v.logprob for t, v in lp.items()} for lp in ref]
    assert [set(top) for top in sampled.top_logprobs] == [set(w) for w in want]
    assert all(token in top for token, top in zip(sampled.tokens, sampled.top_logprobs))

    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                            logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for c in chunks for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def _completion_name(tokenizer, token_id: int) -> str:
    """A token's name in the completions logprobs: its text, or its bytes where they are part of a
    character (the legacy OpenAI API's `bytes:\\xNN` form)."""
    raw = tokenizer.token_bytes(token_id)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return tokenizer.decode([token_id], skip_special_tokens=False)


def test_completion_top_logprobs_name_the_bytes_of_a_split_character(tokenizer):
    """The two byte tokens of "é" both decode to U+FFFD alone: the completions dict names them by their
    bytes (the legacy API's form), so neither overwrites the other and every position keeps k + 1
    entries, the chosen token's under its own logprob."""
    from runtime.engine.outputs import TokenLogprobs
    from runtime.server.choices import Choice, _completion_logprobs
    first, second = tokenizer.token_id("<0xC3>"), tokenizer.token_id("<0xA9>")
    word = tokenizer.encode("the")[0]
    lps = [TokenLogprobs(first, -0.5, 2, ((second, -0.25), (word, -3.0))),
           TokenLogprobs(second, -0.1, 1, ((second, -0.1), (first, -4.0)))]
    out = _completion_logprobs(tokenizer, Choice(0, "r", 0, 3, text=None), lps, with_prompt=False)
    assert out["tokens"] == ["bytes:\\xc3", "bytes:\\xa9"]
    assert out["top_logprobs"] == [
        {"bytes:\\xc3": -0.5, "bytes:\\xa9": -0.25, tokenizer.decode([word]): -3.0},
        {"bytes:\\xa9": -0.1, "bytes:\\xc3": -4.0}]


def test_echo_returns_the_prompt_and_its_logprobs(client, offline, tokenizer):
    ids = tokenizer.encode(PROMPT)
    ref = offline(ids, max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(tokenizer.decode(ids)) and len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [p.logprob for p in ref.prompt_logprobs[1:]] + [ref.logprobs[0].logprob]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None
    chunks = list(client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, logprobs=0,
                                            echo=True, stream=True))
    text = "".join(ch.text for c in chunks for ch in c.choices)
    entries = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.token_logprobs]
    assert text.startswith(tokenizer.decode(ids)) and len(entries) == len(ids) + 2 and entries[0] is None


def test_echo_of_token_ids_with_special_tokens_keeps_them_and_their_offsets(client, tokenizer):
    """A token prompt is echoed as given, special tokens included (as vLLM does): every prompt token
    gets its entry, and each offset points at its token's text."""
    for ids in ([0, *tokenizer.encode("the cat"), 0, *tokenizer.encode("sat")], [0, 0, 0]):
        out = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0, logprobs=0,
                                        echo=True, extra_body={"ignore_eos": True, "skip_special_tokens": False})
        choice = choice_of(out)
        lp, text = choice.logprobs, choice.text
        assert text.startswith(tokenizer.decode(ids, skip_special_tokens=False)) and len(lp.tokens) == len(ids) + 2
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
        assert all(text[o:o + len(t)] == t for t, o in zip(lp.tokens, lp.text_offset)), (text, lp)


def choice_of(out):
    assert len(out.choices) == 1
    return out.choices[0]


def test_chat_logprobs_streamed_and_not(client):
    messages = [{"role": "user", "content": "hello, how are you?"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-6)
    assert "".join(t.token for t in content) == out.choices[0].message.content
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                 logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t.logprob for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    assert streamed == pytest.approx([t.logprob for t in content], abs=1e-6)
    none = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert none.choices[0].logprobs is None


def test_n_returns_n_choices(client, offline):
    out = client.completions.create(model="tiny", prompt=[PROMPT, "hello"], max_tokens=5, n=3, seed=4,
                                    temperature=1.0, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == list(range(6)) and out.usage.completion_tokens == 30
    first = [c.text for c in sorted(out.choices, key=lambda c: c.index)][:3]
    assert len(set(first)) > 1
    assert first[0] == offline(PROMPT, max_tokens=5, temperature=1.0, seed=4, ignore_eos=True).text
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, n=2, stream=True))
    assert {ch.index for c in chunks for ch in c.choices if ch.finish_reason} == {0, 1}
    best = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2, best_of=4, seed=1,
                                     temperature=1.0)
    assert len(best.choices) == 2


def test_penalties_and_logit_bias_reach_the_sampler(client, offline, tokenizer):
    forced = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                       logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == tokenizer.decode([42] * 4)
    options = dict(presence_penalty=1.5, frequency_penalty=1.0)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True, "repetition_penalty": 1.2}, **options)
    ref = offline(PROMPT, max_tokens=8, temperature=0, ignore_eos=True, repetition_penalty=1.2, **options)
    assert out.choices[0].text == ref.text != offline(PROMPT, max_tokens=8, temperature=0, ignore_eos=True).text


def test_stop_strings_follow_the_offline_engine(client, offline):
    """Stop strings end samples in the engine: the served text, usage and stop_reason are the offline
    ones, with min_tokens (text of the first tokens is not searched) and best_of (samples ranked
    after they stopped) as well."""
    plain = offline(PROMPT, max_tokens=10, temperature=0, ignore_eos=True)
    stop = plain.text[1:3]
    cases = [dict(temperature=0), dict(temperature=0, min_tokens=2),
             dict(temperature=0, include_stop_str_in_output=True), dict(temperature=1.0, seed=5, best_of=3)]
    for case in cases:
        ref = offline(PROMPT, max_tokens=10, ignore_eos=True, stop=[stop], **case)
        extra = {k: v for k, v in case.items() if k in ("min_tokens", "include_stop_str_in_output")}
        body = {k: v for k, v in case.items() if k not in extra}
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, stop=[stop], **body,
                                        extra_body={"ignore_eos": True, **extra})
        choice = out.choices[0]
        assert (choice.text, choice.finish_reason) == (ref.text, ref.finish_reason), case
        assert out.usage.completion_tokens == len(ref.token_ids), case
        if ref.finish_reason == "stop":
            assert choice.model_extra["stop_reason"] == stop
        if "best_of" in case:
            continue                                # (not streamed: the best are known only at the end)
        chunks = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, stop=[stop], **body,
                                           stream=True, extra_body={"ignore_eos": True, **extra})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text, case


def test_logprobs_bytes_and_offsets_of_split_characters(client, tokenizer):
    """A character split over byte tokens: each token's `bytes` are its own byte (not U+FFFD's), and
    every completions `text_offset` indexes the returned text (they were one past per such character)."""
    from pathlib import Path

    import zoo
    from runtime.text.tokenizer import Tokenizer

    c3, a9 = tokenizer.token_id("<0xC3>"), tokenizer.token_id("<0xA9>")
    assert (tokenizer.token_bytes(c3), tokenizer.token_bytes(a9)) == (b"\xc3", b"\xa9")
    byte_level = Tokenizer.from_folder(Path(zoo.__file__).parent / "checkpoints" / "ouro-tiny")
    ids = byte_level.encode("café 🙂 x")
    assert b"".join(byte_level.token_bytes(i) for i in ids).decode() == "café 🙂 x"
    out = client.completions.create(model="tiny", prompt="café au lait", echo=True, max_tokens=3, temperature=0,
                                    logprobs=0)
    text, lp = out.choices[0].text, out.choices[0].logprobs
    assert lp.tokens[3:5] == ["bytes:\\xc3", "bytes:\\xa9"] and lp.text_offset[3:5] == [3, 3]    # "é"
    placed = [(t, o) for t, o in zip(lp.tokens, lp.text_offset) if not t.startswith("bytes:")]
    assert len(placed) > 3 and all(text[o:o + len(t)] == t for t, o in placed), (text, lp.tokens, lp.text_offset)


@pytest.mark.parametrize("ids, offsets", [([268, 225, 3203], [0, 4, 5]), ([268, 225, 225, 3203], [0, 4, 4, 6]),
                                          ([268, 225, 0], [0, 4, 5]),
                                           ("café 🙂 x", [0, 2, 3, 4, 5, 5, 5, 5, 6]),
                                           ("€ and 🙂", [0, 0, 0, 1, 5, 6, 6, 6, 6])])
def test_text_offsets_after_a_stray_byte_and_inside_characters(ids, offsets):
    """Completions `text_offset` on a byte-level tokenizer: a stray byte (b"\\x80", which never completes
    a character and stays U+FFFD in the text) takes one character, so the token after it starts one
    later (it was placed on the U+FFFD, found by a helper's fuzzer); a character's byte tokens all
    start where it starts; a special token the text skips starts where the text before it ends. A
    second stray byte right after one looks like a character's next byte and gets the first's offset."""
    from pathlib import Path

    import zoo
    from runtime.server.choices import _Offsets
    from runtime.text.tokenizer import Tokenizer

    byte_level = Tokenizer.from_folder(Path(zoo.__file__).parent / "checkpoints" / "ouro-tiny")
    ids = byte_level.encode(ids) if isinstance(ids, str) else ids
    where = _Offsets(byte_level, base=7)
    assert [where.next(i) - 7 for i in ids] == offsets
    text = byte_level.decode(ids)
    assert all(text[o:].startswith(byte_level.decode([i])) for i, o in zip(ids, offsets) if byte_level.decode([i]) != "\ufffd")


@pytest.mark.parametrize("text, offsets", [("a €b", [0, 1, 2, 2, 2, 3]), ("cat 😀 x", [0, 1, 3, 4, 4, 4, 4, 5, 6])])
def test_text_offsets_inside_characters_on_a_byte_fallback_tokenizer(tokenizer, text, offsets):
    """A byte-fallback decoder shows a U+FFFD per pending byte (a byte-level one a single U+FFFD):
    every byte of a character still starts where the character starts (found by a review)."""
    from runtime.server.choices import _Offsets

    ids = tokenizer.encode(text)
    where = _Offsets(tokenizer)
    assert [where.next(i) for i in ids] == offsets and tokenizer.decode(ids) == text


def test_tokenizer_endpoints(server, tokenizer):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
        assert ids == tokenizer.encode_prompt(PROMPT) == tokenizer.encode(PROMPT)   # no post-processor
        assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == tokenizer.decode(ids)
        info = http.get("/tokenizer_info").json()
        assert info["eos_token"] == "<|im_end|>" and "chat_template" in info
        assert http.post("/detokenize", json={"tokens": [10**6]}).status_code == 400


def with_post_processor(tokenizer: Tokenizer, single: str) -> Tokenizer:
    """The test tokenizer with a tokenizer.json post-processor: "<|endoftext|> $A" adds a BOS as
    Llama's does, "<|endoftext|> $A <|im_end|>" an end token too, as Huginn-0125's does; its chat
    template writes the BOS itself."""
    from tokenizers import Tokenizer as Backend, processors

    backend = Backend.from_str(tokenizer.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[("<|endoftext|>", 0), ("<|im_end|>", 2)])
    return Tokenizer(backend, {**tokenizer.config, "bos_token": "<|endoftext|>",
                               "chat_template": "{{ bos_token }}" + CHAT_TEMPLATE})


@pytest.mark.parametrize("single", ["<|endoftext|> $A", "<|endoftext|> $A <|im_end|>"])
def test_completion_prompts_get_the_bos_and_chat_prompts_only_the_templates(tiny_model, tokenizer, live_server,
                                                                           single):
    """As vLLM: a completion's text prompt gets the tokenizer's special tokens (less an appended end
    token: the prompt is to be continued) unless add_special_tokens is false; /tokenize gives those
    same ids by default; the chat template's text is encoded as written, its one BOS included."""
    bos = with_post_processor(tokenizer, single)
    engine = LLMEngine(tiny_model, hal.get("cpu"), EngineConfig(num_kv_blocks=64), bos)
    server = live_server(build_app(engine, ServerConfig(model_name="tiny")))
    plain = tokenizer.encode(PROMPT)
    assert bos.encode(PROMPT) == plain and 0 not in plain and 2 not in plain
    fed = [0, *plain]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"] == fed
        unspecial = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
        assert unspecial["tokens"] == plain
        request = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
                   "echo": True, "logprobs": 0}
        out = http.post("/v1/completions", json=request).json()
        lp = out["choices"][0]["logprobs"]
        assert out["usage"]["prompt_tokens"] == len(fed) and out["choices"][0]["text"].startswith(PROMPT)
        assert lp["tokens"][:len(fed)] == [bos.decode([t], skip_special_tokens=False) for t in fed]
        assert lp["tokens"][0] == "<|endoftext|>" and lp["token_logprobs"][0] is None
        # the BOS is not in the echoed text: it and the first word both sit at offset 0
        text = out["choices"][0]["text"]
        assert lp["text_offset"][:2] == [0, 0]
        assert all(text[o:o + len(t)] == t for t, o in zip(lp["tokens"][1:], lp["text_offset"][1:]))
        without = http.post("/v1/completions", json={**request, "add_special_tokens": False}).json()
        assert without["usage"]["prompt_tokens"] == len(plain)
        assert without["choices"][0]["logprobs"]["tokens"][:len(plain)] == lp["tokens"][1:len(fed)]
        chat = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "hello"}]}).json()
        rendered = "<|endoftext|><|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
        ids = bos.encode(rendered)
        assert ids.count(0) == 1 and ids[0] == 0 and chat["usage"]["prompt_tokens"] == len(ids)


def composed(name, *overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=list(overrides))


def test_served_defaults_are_the_clis(checkpoint, tiny_model, tokenizer):
    """A request without temperature gets the model's generation_config, as runtime.generate: for
    a model whose config sets none (Ouro), greedy, so both give the same text."""
    from runtime import generate
    from runtime.serve import make_app

    options = ["hal=cpu", f"model.path={checkpoint}", "model.dtype=float32", "engine.num_kv_blocks=64"]
    (cli,) = generate.run(composed("generate", *options, f"prompt={PROMPT}", "max_tokens=8", "ignore_eos=true"))
    app = make_app(composed("serve", *options))
    with LiveServer(app) as live:
        http = httpx.Client(base_url=live.url, timeout=60)
        out = http.post("/v1/completions", json={"model": checkpoint.name, "prompt": PROMPT, "max_tokens": 8,
                                                 "ignore_eos": True}).json()
        models = http.get("/v1/models").json()["data"][0]
    assert out["choices"][0]["text"] == cli["text"]
    assert models["sampling_defaults"] == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                           "repetition_penalty": 1.0}
    nanbeige = SamplingDefaults.from_model(composed("serve", "model=nanbeige4.2-3b").model)
    assert nanbeige == SamplingDefaults(0.6, 0.95, 20)
    engine = LLMEngine(tiny_model, hal.get("cpu"), EngineConfig(num_kv_blocks=64), tokenizer)
    with LiveServer(build_app(engine, ServerConfig(model_name="tiny", sampling=nanbeige))) as live:
        models = httpx.get(f"{live.url}/v1/models").json()["data"][0]
        assert models["sampling_defaults"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                               "repetition_penalty": 1.0}


def test_the_model_nodes_stop_tokens_yield_to_ignore_eos_and_chat_fills_the_context(checkpoint, offline):
    """model.stop_token_ids end a request as the config's eos does, in the CLI and the server, and
    `ignore_eos` lifts them too (as vLLM ignores generation_config's eos ids); a chat completion without
    max_tokens may run to the end of the context, a completion stops at server.default_max_tokens."""
    from runtime import generate
    from runtime.serve import make_app

    first = offline(PROMPT, max_tokens=1, temperature=0, ignore_eos=True).token_ids[0]
    options = ["hal=cpu", f"model.path={checkpoint}", "model.dtype=float32", "engine.num_kv_blocks=64",
               f"model.stop_token_ids=[{first}]"]
    for ignore in (False, True):
        (cli,) = generate.run(composed("generate", *options, f"prompt={PROMPT}", "max_tokens=5", "temperature=0",
                                       f"ignore_eos={str(ignore).lower()}"))
        assert (len(cli["token_ids"]), cli["finish_reason"]) == ((5, "length") if ignore else (1, "stop"))
    app = make_app(composed("serve", *options, "server.default_max_tokens=3", "engine.max_model_len=64"))
    with LiveServer(app) as live:
        http = httpx.Client(base_url=live.url, timeout=60)
        for ignore in (False, True):
            out = http.post("/v1/completions", json={"model": checkpoint.name, "prompt": PROMPT, "max_tokens": 5,
                                                     "temperature": 0, "ignore_eos": ignore}).json()
            assert out["usage"]["completion_tokens"] == (5 if ignore else 1)
            assert out["choices"][0]["finish_reason"] == ("length" if ignore else "stop")
        body = {"model": checkpoint.name, "temperature": 0, "ignore_eos": True}
        short = http.post("/v1/completions", json={**body, "prompt": PROMPT}).json()
        assert short["usage"]["completion_tokens"] == 3                      # server.default_max_tokens
        chat = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]})
        usage = chat.json()["usage"]
        assert usage["prompt_tokens"] + usage["completion_tokens"] == 64     # the whole context
        assert chat.json()["choices"][0]["finish_reason"] == "length"


def test_vllm_sampling_extras_and_neutral_openai_fields(client, server, offline, tokenizer):
    """min_p and skip_special_tokens reach the engine (the offline engine's text); a chat's
    add_generation_prompt reaches the template; stream_options.continuous_usage_stats puts the usage
    so far on every chunk; OpenAI fields without effect here are accepted at their neutral values
    and refused otherwise."""
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=2.0, seed=3,
                                    extra_body={"min_p": 0.3, "ignore_eos": True})
    assert out.choices[0].text == offline(PROMPT, min_p=0.3, max_tokens=8, temperature=2.0, seed=3,
                                          ignore_eos=True).text
    eos = tokenizer.eos_token_id
    special = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
               "logit_bias": {str(eos): 100}}
    http = httpx.Client(base_url=server.url, timeout=60)
    assert "<|im_end|>" not in http.post("/v1/completions", json=special).json()["choices"][0]["text"]
    kept = http.post("/v1/completions", json={**special, "skip_special_tokens": False}).json()
    offsets = http.post("/v1/completions", json={**special, "skip_special_tokens": False, "logprobs": 0}).json()
    lp = offsets["choices"][0]["logprobs"]
    assert lp["text_offset"] == [0, len("<|im_end|>")]      # offsets into the text as returned
    kept = kept["choices"][0]["text"]
    assert kept == "<|im_end|><|im_end|>" == offline(PROMPT, max_tokens=2, temperature=0, ignore_eos=True,
                                                     logit_bias={eos: 100}, skip_special_tokens=False).text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    with_prompt = http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"]
    without = http.post("/v1/chat/completions", json={**chat, "add_generation_prompt": False}).json()
    assert without["usage"]["prompt_tokens"] == with_prompt - len(tokenizer.encode("<|im_start|>assistant\n"))
    alone = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, stream=True,
                                           extra_body={"stream_options": {"continuous_usage_stats": True}}))
    assert all(c.usage is None for c in alone)              # vLLM: only with include_usage
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "stream_options": options}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 4 and chunks[-1].usage.total_tokens == counts[-1] + \
        chunks[-1].usage.prompt_tokens
    neutral = {"tool_choice": "none", "response_format": {"type": "text"}, "metadata": {"team": "a"},
               "store": False, "parallel_tool_calls": True, "seed": -5}
    assert http.post("/v1/chat/completions", json={**chat, **neutral}).status_code == 200
    for field, value in (("response_format", {"type": "json_object"}), ("store", True),
                         ("tool_choice", {"type": "function", "function": {"name": "f"}})):
        refused = http.post("/v1/chat/completions", json={**chat, field: value})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    assert http.post("/v1/completions", json={**special, "min_p": 1.5}).status_code == 400
    assert http.post("/v1/completions", json={**special, "temperature": 3.0}).status_code == 200   # vLLM: no cap
    assert http.post("/v1/completions", json={**special, "temperature": -0.5}).status_code == 400
