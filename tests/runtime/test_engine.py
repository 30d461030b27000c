"""The engine (continuous batching, paged per-depth KV, packed and chunked prefill, early exit)
gives exactly the simple path's tokens."""
import dataclasses
import json
import random

import pytest
import torch

import hal
import zoo
from helpers import golden_case, golden_names
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.execution.reference import generate_reference

CPU = hal.get("cpu")


def engine_for(model, **config):
    return LLMEngine(model, CPU, EngineConfig(**config))


def golden_params(case):
    meta = case.meta
    return SamplingParams(max_tokens=meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True,
                          num_loops=meta.get("greedy_num_steps"), init_scale=0.0) if "init_scale" in \
        SamplingParams.__dataclass_fields__ else SamplingParams(max_tokens=meta["greedy_new_tokens"],
                                                                temperature=0.0, ignore_eos=True,
                                                                num_loops=meta.get("greedy_num_steps"))


@pytest.mark.parametrize("name", golden_names())
@pytest.mark.parametrize("arrival", ["together", "staggered"])
def test_golden_greedy_through_the_engine(name, arrival):
    if name.startswith(("huginn", "nanbeige")) and not _family_available(name):
        pytest.skip("family not in the zoo yet")
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32")
    engine = engine_for(model, max_num_batched_tokens=7, block_size=4)      # forces chunked prefill
    params = golden_params(case)
    pending = [(str(i), case.prompt(i)) for i in range(case.num_prompts)]
    outputs = {}
    while pending or engine.has_unfinished_requests():
        if pending:
            for rid, prompt in (pending if arrival == "together" else pending[:1]):
                engine.add_request(rid, prompt, params)
            pending = [] if arrival == "together" else pending[1:]
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    for i in range(case.num_prompts):
        assert outputs[str(i)].token_ids == case.greedy(i), f"prompt {i}"
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def _family_available(name):
    try:
        zoo.model_class(json.loads((golden_case(name).path / "config.json").read_text())["model_type"])
        return True
    except Exception:
        return False


def random_ouro(rng: random.Random, seed: int):
    heads = rng.choice([2, 4])
    config = {"model_type": "ouro", "vocab_size": rng.choice([61, 96]), "hidden_size": rng.choice([32, 48]),
              "intermediate_size": 64, "num_hidden_layers": rng.choice([1, 2]), "num_attention_heads": heads,
              "num_key_value_heads": rng.choice([k for k in (1, 2, 4) if heads % k == 0]),
              "head_dim": rng.choice([8, 12, 16]), "total_ut_steps": rng.choice([2, 3, 4]),
              "max_position_embeddings": 128, "rope_theta": 10000.0, "eos_token_id": 0}
    model = zoo.from_config(config, dtype="float32", seed=seed)
    with torch.no_grad():                    # sharper weights: decisive logits and exit gates
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
        model.model.early_exit_gate.bias.fill_(rng.uniform(-1.5, 1.5))
    return model


def run_engine(engine, prompts, params, arrive_every):
    outputs, pending, step = {}, list(enumerate(zip(prompts, params))), 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step // max(arrive_every, 1) * max(arrive_every, 1) + \
                (len(prompts) if arrive_every == 0 else 0):
            i, (prompt, p) = pending.pop(0)
            engine.add_request(str(i), prompt, p)
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
        step += 1
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("seed", range(16))
def test_engine_equals_simple_path_on_random_batches(seed):
    """kv_mode=full: token-for-token equality with the simple path, with and without early exit,
    per-request loop counts, chunked prefill, small blocks and preemption under a small cache."""
    rng = random.Random(seed)
    model = random_ouro(rng, seed)
    num_loops = model.default_num_loops
    prompts = [[rng.randrange(1, model.config.vocab_size) for _ in range(rng.randint(1, 20))]
               for _ in range(rng.randint(2, 6))]
    params = [SamplingParams(max_tokens=rng.randint(1, 12), temperature=0.0,
                             num_loops=rng.choice([None, None, 1, num_loops + 1]),
                             exit_threshold=rng.choice([None, None, 0.3, 0.6, 0.9]),
                             ignore_eos=rng.random() < 0.5)
              for _ in prompts]
    block_size = rng.choice([2, 4, 16])
    # a tight cache (room for the largest request and a little more) forces preemptions
    largest = max(((p.num_loops or num_loops) + 1) * -(-(len(q) + p.max_tokens + 1) // block_size)
                  for q, p in zip(prompts, params))
    num_blocks = rng.choice([None, largest + 2])
    engine = engine_for(model, max_num_batched_tokens=rng.choice([3, 8, 64]), block_size=block_size,
                        num_kv_blocks=num_blocks, max_num_seqs=rng.choice([2, 8]))
    outs = run_engine(engine, prompts, params, arrive_every=rng.choice([0, 1, 2]))
    print(f"seed {seed}: {sum(o.metrics.num_preemptions for o in outs)} preemptions, "
          f"{sum(len(o.token_ids) for o in outs)} tokens")
    for prompt, p, out in zip(prompts, params, outs):
        tokens, reason, loops = generate_reference(model, prompt, p, model.stop_token_ids())
        assert out.token_ids == tokens and out.finish_reason == reason and out.loops_per_token == loops
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_shared_mode_uses_loops_times_fewer_blocks():
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32")
    loops = model.default_num_loops
    used = {}
    outputs = {}
    for mode in ("full", "shared"):
        engine = engine_for(model, kv_mode=mode, block_size=4)
        for i in range(case.num_prompts):
            engine.add_request(str(i), case.prompt(i), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        engine.step()                                         # every prompt prefilled, blocks held
        used[mode] = engine.blocks.num_blocks - engine.blocks.num_free_blocks
        outputs[mode] = [o.token_ids for o in sorted(engine.run_until_done(), key=lambda o: o.request_id)]
    assert used["full"] == loops * used["shared"]
    agree = sum(a == b for f, s in zip(outputs["full"], outputs["shared"]) for a, b in zip(f, s))
    total = sum(len(f) for f in outputs["full"])
    print(f"kv_mode=shared vs full greedy agreement on ouro-tiny: {agree}/{total} tokens")


def test_last_exited_skips_loops_and_fills_the_skipped_planes():
    torch.manual_seed(0)
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32")
    with torch.no_grad():
        model.model.early_exit_gate.bias.fill_(2.0)          # confident gates: early exits
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, exit_threshold=0.5)
    engine = engine_for(model, kv_mode="last_exited", block_size=4)
    engine.add_request("a", case.prompt(1), params)
    copied = []
    original = engine.runner.fill_skipped_planes
    engine.runner.fill_skipped_planes = lambda *a: (copied.append(a[0]), original(*a))
    out = engine.run_until_done()[0]
    assert min(out.loops_per_token[1:]) < model.default_num_loops      # decode tokens really exited
    assert copied, "no skipped plane was filled"
    # same threshold with every loop run (full mode) picks the same exit loops for the first token
    full = engine_for(model, kv_mode="full", block_size=4)
    full.add_request("a", case.prompt(1), params)
    ref = full.run_until_done()[0]
    assert out.token_ids[0] == ref.token_ids[0] and out.loops_per_token[0] == ref.loops_per_token[0]
    print(f"last_exited loops per token {out.loops_per_token}; full {ref.loops_per_token}")


def test_last_exited_without_exit_equals_full():
    case = golden_case("ouro-tiny-gqa-bf16")
    model = zoo.from_pretrained(case.path, dtype="float32")
    engine = engine_for(model, kv_mode="last_exited", block_size=4, max_num_batched_tokens=5)
    for i in range(case.num_prompts):
        engine.add_request(str(i), case.prompt(i), golden_params(case))
    outs = {o.request_id: o for o in engine.run_until_done()}
    assert [outs[str(i)].token_ids for i in range(case.num_prompts)] == [case.greedy(i) for i in range(2)]


def test_oversized_request_is_rejected_alone():
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32")
    engine = engine_for(model, block_size=4, num_kv_blocks=24)           # 6 blocks per plane x 4 planes
    with pytest.raises(MemoryError, match="more than the whole cache"):
        engine.add_request("big", list(range(1, 30)), SamplingParams(max_tokens=4))
    engine.add_request("ok", case.prompt(0), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    (out,) = engine.run_until_done()
    assert out.token_ids == case.greedy(0)[:4]


def test_llm_generate_reports_rejected_prompt_and_serves_the_rest():
    from runtime import LLM

    case = golden_case("ouro-tiny")
    llm = LLM(case.path, hal="cpu", dtype="float32", block_size=4, num_kv_blocks=24)
    outs = llm.generate([list(range(1, 30)), case.prompt(0)], SamplingParams(max_tokens=4, temperature=0,
                                                                            ignore_eos=True))
    assert outs[0].finish_reason == "error" and "whole cache" in outs[0].error
    assert outs[1].token_ids == case.greedy(0)[:4]


def test_a_failed_step_leaves_the_llm_usable_and_bad_settings_are_named(monkeypatch):
    """A step that raises (here once, on purpose) ends that generate() call, and nothing of it stays
    in the engine: the next call gives the golden tokens. Settings of the wrong type are refused by
    name before anything runs."""
    from runtime import LLM

    case = golden_case("ouro-tiny")
    llm = LLM(case.path, hal="cpu", dtype="float32", block_size=4)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    step = llm.engine.step
    calls = iter(range(100))

    def failing_once():
        if next(calls) == 1:
            raise RuntimeError("a step failed")
        return step()
    monkeypatch.setattr(llm.engine, "step", failing_once)
    with pytest.raises(RuntimeError, match="a step failed"):
        llm.generate([case.prompt(0), case.prompt(1)], params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    assert [o.token_ids for o in llm.generate([case.prompt(0)], params)] == [case.greedy(0)[:4]]
    for prompt in (b"abc", memoryview(b"abc"), [b"abc"], [{"prompt_token_ids": bytearray(b"ab")}]):
        with pytest.raises(TypeError, match="not bytes"):
            llm.generate(prompt, params)
    with pytest.raises(ValueError, match="enable_prefix_caching must be true or false, got 'no'"):
        EngineConfig(enable_prefix_caching="no")
    with pytest.raises(TypeError, match=r"sampling_params takes SamplingParams .* pass SamplingParams\(\*\*\{'max_tokens': 3\}\)"):
        llm.generate("hi", {"max_tokens": 3})
    for keywords, message in ((dict(hal=5), "hal takes a name"), (dict(tokenizer=5), "tokenizer takes a folder"),
                              (dict(engine_config={"max_num_seqs": 2}), "engine_config takes an EngineConfig")):
        with pytest.raises(TypeError, match=message):
            LLM(case.path, **keywords)
    for bad, name in ((dict(min_loops=2 ** 70), "min_loops"), (dict(top_k=-5), "top_k"), (dict(ignore_eos="no"), "ignore_eos"),
                      (dict(stop_token_ids="12"), "stop_token_ids"), (dict(temperature="1"), "temperature"),
                      (dict(logit_bias=[1, 2]), "logit_bias")):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**bad)


def test_a_cache_larger_than_the_device_or_a_block_past_the_context_is_refused_by_name():
    """Before anything is allocated (on the CPU an allocation past memory gets the process killed,
    without a message)."""
    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")
    with pytest.raises(MemoryError, match=r"more than the device's .* GiB: lower engine.num_kv_blocks"):
        engine_for(model, num_kv_blocks=10 ** 12)
    with pytest.raises(ValueError, match=r"engine.block_size=1000000 is more tokens than a request can hold"):
        engine_for(model, block_size=10 ** 6)
    with pytest.raises(MemoryError, match=r"raise engine.kv_cache_memory_bytes"):
        engine_for(model, kv_cache_memory_bytes=10)


def test_a_cache_larger_than_the_free_memory_is_allocated_with_a_warning_naming_the_setting(monkeypatch, caplog):
    """The CPU maps a pool's pages as requests write them, so a pool past the memory free at start
    would fail only once requests fill it: the start says so, with the setting that sized it."""
    from hal.base import MemInfo
    from hal.cpu import CpuHal

    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")
    monkeypatch.setattr(CpuHal, "mem_info", lambda self: MemInfo(1 << 20, 64 << 30))
    with caplog.at_level("WARNING", logger="runtime.execution.kv_pool"):
        engine_for(model, num_kv_blocks=4096)
    assert "more than the 0.0 GiB free now" in caplog.text and "lower engine.num_kv_blocks" in caplog.text
    caplog.clear()
    monkeypatch.setattr(CpuHal, "mem_info", lambda self: MemInfo(60 << 30, 64 << 30))
    with caplog.at_level("WARNING", logger="runtime.execution.kv_pool"):
        engine_for(model, num_kv_blocks=4096)
    assert "free now" not in caplog.text


def test_abort_frees_blocks_and_streaming_yields_every_token():
    from runtime import LLM

    case = golden_case("ouro-tiny")
    llm = LLM(case.path, hal="cpu", dtype="float32", block_size=4)
    engine = llm.engine
    engine.add_request("x", case.prompt(2), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.step()
    engine.abort("x")
    assert not engine.has_unfinished_requests() and engine.blocks.num_free_blocks == engine.blocks.num_blocks
    seen = [o.token_ids for o in llm.stream(case.prompt(0), SamplingParams(max_tokens=5, temperature=0,
                                                                           ignore_eos=True))]
    assert [len(t) for t in seen] == [1, 2, 3, 4, 5] and seen[-1] == case.greedy(0)[:5]


def test_metrics_are_recorded():
    case = golden_case("ouro-tiny")
    engine = engine_for(zoo.from_pretrained(case.path, dtype="float32"))
    engine.add_request("m", case.prompt(0), SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    (out,) = engine.run_until_done()
    m = out.metrics
    assert m.time_to_first_token is not None and m.time_to_first_token >= 0
    assert m.finished_time >= m.first_token_time >= m.first_scheduled_time >= m.arrival_time
    assert out.loops_per_token == [4, 4, 4]


@pytest.mark.parametrize("seed", range(4))
def test_decode_graphs_give_the_same_tokens(seed):
    """The captured-graph decode path (eager replay on the CPU: same static buffers, padding rows,
    in-place metadata updates) equals the plain path, over batches that shrink as requests finish."""
    rng = random.Random(100 + seed)
    model = random_ouro(rng, seed)
    prompts = [[rng.randrange(1, model.config.vocab_size) for _ in range(rng.randint(1, 12))] for _ in range(5)]
    params = [SamplingParams(max_tokens=rng.randint(2, 10), temperature=0.0, ignore_eos=True) for _ in prompts]
    results = {}
    for graphs in (False, True):
        engine = engine_for(model, block_size=4, graphs=graphs, max_num_seqs=6)
        results[graphs] = [o.token_ids for o in run_engine(engine, prompts, params, arrive_every=1)]
        if graphs:
            assert engine.runner.graphs.captured, "no decode graph was used"
    assert results[True] == results[False]


def _confident_ouro(bias: float):
    """A small random Ouro with sharp weights and exit gates of bias `bias` (hazards near 1)."""
    config = {"model_type": "ouro", "vocab_size": 61, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
              "total_ut_steps": 3, "max_position_embeddings": 128, "rope_theta": 10000.0, "eos_token_id": 0}
    model = zoo.from_config(config, dtype="float32", seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
        model.model.early_exit_gate.bias.fill_(bias)
    return model


def _engine_outputs(model, prompts, params):
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(block_size=4, num_kv_blocks=64))
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    outs = {o.request_id: o for o in engine.run_until_done()}
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    return [outs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("bias", [8.0, 30.0])
def test_threshold_one_runs_every_loop_beside_early_exit(bias):
    """A request at exit_threshold=1 batched with an early-exit one: float32 rounding brought its
    cumulative exit probability to 1.0 before its last loop, and its logits came from there."""
    model = _confident_ouro(bias)
    full = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, exit_threshold=1.0)
    early = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    tokens, _, loops = generate_reference(model, [3, 5, 7, 9], full)
    out = _engine_outputs(model, [[3, 5, 7, 9], [2, 4, 6]], [full, early])[0]
    assert (out.token_ids, out.loops_per_token) == (tokens, loops) and loops == [3] * 4


def test_min_loops_past_num_loops_takes_the_last_loop():
    """"Never before min_loops": with num_loops=2 and min_loops=3 every token takes its last loop
    (it took loop 1), in the engine and in the simple path."""
    model = _confident_ouro(0.5)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, exit_threshold=0.5, num_loops=2,
                            min_loops=3)
    tokens, _, loops = generate_reference(model, [3, 5, 7, 9], params)
    assert loops == [2] * 4
    assert generate_reference(model, [3, 5, 7, 9], dataclasses.replace(params, exit_threshold=1.0))[0] == tokens
    out = _engine_outputs(model, [[3, 5, 7, 9]], [params])[0]
    assert (out.token_ids, out.loops_per_token) == (tokens, loops)


def test_prompt_logprobs_of_a_one_token_prompt_is_one_none():
    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    two, one = _engine_outputs(model, [[5, 9], [5]], [params, params])
    assert len(two.prompt_logprobs) == 2 and two.prompt_logprobs[0] is None and two.prompt_logprobs[1] is not None
    assert one.prompt_logprobs == [None]


def test_stop_token_ids_out_of_range_are_refused_at_start():
    """The model node's end tokens join the engine's stop set, which the persistent batch stores as
    int64: a bad one is refused when the engine starts, not at the first row write."""
    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")
    with pytest.raises(ValueError, match=r"stop token ids must be integers in \[0, 2\^63\), got \[-1\]"):
        LLMEngine(model, hal.get("cpu"), EngineConfig(num_kv_blocks=16), extra_stop_token_ids=[-1])
