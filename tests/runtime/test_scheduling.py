"""Scheduling features through the engine (docs/scheduling.md): prefix caching, swap and recompute
preemption, priorities, async scheduling and wavefront prefill each give exactly the greedy tokens
of the simple path, alone and combined, under memory pressure."""
import random

import pytest
import torch
from helpers import golden_case, golden_names
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine import golden_params, random_ouro, run_engine

import hal
import zoo
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.execution.reference import generate_reference

CPU = hal.get("cpu")
ALL_ON = dict(enable_prefix_caching=True, scheduling_policy="priority", async_scheduling=True,
              wavefront_prefill=True)


def counting(engine):
    """Count what the scheduler did (wave segments, preemptions, swaps) by wrapping `schedule`."""
    counts = {"wave": 0, "preempted": 0, "swap_out": 0, "swap_in": 0}
    schedule = engine.scheduler.schedule

    def wrapped():
        out = schedule()
        counts["wave"] += sum(item.is_wave for item in out.scheduled)
        counts["preempted"] += len(out.preempted)
        counts["swap_out"] += len(out.swap_out)
        counts["swap_in"] += len(out.swap_in)
        return out

    engine.scheduler.schedule = wrapped
    return counts


def assert_clean(engine):
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.swap.host and not engine.scheduler.swapped and not engine.runner.wave_states


@pytest.mark.parametrize("name,preemption", list(zip(golden_names(), ["swap", "recompute"] * 4)))
def test_golden_greedy_with_every_feature_under_memory_pressure(name, preemption):
    """Golden cases (Huginn with a zero initial state) with prefix caching, priorities, async
    scheduling and wavefront prefill on, and a cache so small that requests are preempted."""
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32")
    params = golden_params(case)
    planes = (params.num_loops or model.default_num_loops) + model.kv_spec.num_fixed_planes
    longest = max(len(case.prompt(i)) for i in range(case.num_prompts)) + params.max_tokens + 1
    engine = LLMEngine(model, CPU, EngineConfig(max_num_batched_tokens=7, block_size=4, **ALL_ON,
                                                preemption_mode=preemption,
                                                num_kv_blocks=planes * (-(-longest // 4) + 1)))
    counts = counting(engine)
    prompts = [case.prompt(i) for i in range(case.num_prompts)]
    for i, prompt in enumerate(prompts + prompts[:1]):           # the repeat hits the prefix cache
        engine.add_request(str(i), prompt, params, priority=i % 2)
    outs = {o.request_id: o for o in engine.run_until_done()}
    for i in range(len(prompts) + 1):
        assert outs[str(i)].token_ids == case.greedy(i % case.num_prompts), f"prompt {i}"
    assert counts["wave"] and counts["preempted"] and (counts["swap_out"] or preemption == "recompute")
    assert_clean(engine)


@settings(max_examples=10, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 10_000), kv_mode=st.sampled_from(["full", "last_exited"]),
       prefix=st.booleans(), async_=st.booleans(), wave=st.booleans(),
       preemption=st.sampled_from(["recompute", "swap"]), policy=st.sampled_from(["fcfs", "priority"]))
def test_random_configs_equal_the_simple_path(seed, kv_mode, prefix, async_, wave, preemption, policy):
    """Random tiny Ouro configs, prompts sharing prefixes, per-request loops / exit thresholds /
    priorities, tight caches: every feature combination gives the simple path's tokens. (In
    last_exited mode early exit is not the reference's semantics, so there every token runs all loops.)"""
    rng = random.Random(seed)
    model = random_ouro(rng, seed)
    num_loops, vocab = model.default_num_loops, model.config.vocab_size
    stem = [rng.randrange(1, vocab) for _ in range(rng.randint(4, 20))]
    prompts = [stem[:rng.randint(0, len(stem))] + [rng.randrange(1, vocab) for _ in range(rng.randint(1, 6))]
               for _ in range(rng.randint(3, 6))]
    params = [SamplingParams(max_tokens=rng.randint(1, 8), temperature=0.0, priority=rng.randint(0, 2),
                             num_loops=rng.choice([None, None, 1, num_loops + 1]),
                             exit_threshold=rng.choice([None, 0.5]) if kv_mode == "full" else None,
                             ignore_eos=rng.random() < 0.5)
              for _ in prompts]
    block_size = rng.choice([2, 4])
    largest = max(((p.num_loops or num_loops) + 1) * -(-(len(q) + p.max_tokens + 1) // block_size)
                  for q, p in zip(prompts, params))
    engine = LLMEngine(model, CPU, EngineConfig(
        kv_mode=kv_mode, block_size=block_size, num_kv_blocks=largest + rng.randint(0, 8),
        max_num_batched_tokens=rng.choice([3, 5, 8]), max_num_seqs=rng.choice([2, 3, 8]),
        enable_prefix_caching=prefix, async_scheduling=async_, wavefront_prefill=wave,
        preemption_mode=preemption, scheduling_policy=policy))
    outs = run_engine(engine, prompts, params, arrive_every=rng.choice([0, 1, 2]))
    for prompt, p, out in zip(prompts, params, outs):
        tokens, reason, loops = generate_reference(model, prompt, p, model.stop_token_ids())
        assert (out.token_ids, out.finish_reason, out.loops_per_token) == (tokens, reason, loops)
    assert_clean(engine)


def test_prefix_hit_shrinks_the_second_prefill_by_the_cached_fraction():
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32")
    rng = random.Random(3)
    shared = [rng.randrange(1, model.config.vocab_size) for _ in range(18)]
    first = shared + [5, 9]
    second = shared[:17] + [rng.randrange(1, 100) for _ in range(7)]                          # 24 tokens
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    work, outs = {}, {}
    for caching in (False, True):
        config = EngineConfig(block_size=4, num_kv_blocks=256, enable_prefix_caching=caching)
        engine = LLMEngine(model, CPU, config)
        engine.add_request("first", first, params)
        engine.run_until_done()
        before = engine.num_computed_tokens
        engine.add_request("second", second, params)
        (outs[caching],) = engine.run_until_done()
        work[caching] = engine.num_computed_tokens - before
    cached = outs[True].metrics.num_cached_tokens
    assert cached == 16                                        # the 4 full blocks of the 17 shared tokens
    assert work[False] == len(second) + 2                      # its prompt, then 2 decode steps
    assert work[True] == work[False] - cached
    assert outs[True].token_ids == outs[False].token_ids
    assert engine.blocks.cache.num_hits >= 1


def test_swap_resumes_without_recomputing_and_recompute_recomputes():
    rng = random.Random(5)
    model = random_ouro(rng, 5)
    prompts = [[rng.randrange(1, model.config.vocab_size) for _ in range(9)] for _ in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    planes, tokens_each = model.default_num_loops, 9 + 12
    results = {}
    for mode in ("recompute", "swap"):
        engine = LLMEngine(model, CPU, EngineConfig(block_size=4, num_kv_blocks=planes * 10,
                                                    preemption_mode=mode))
        counts = counting(engine)
        outs = run_engine(engine, prompts, [params] * 4, arrive_every=0)
        results[mode] = ([o.token_ids for o in outs], engine.num_computed_tokens, counts)
        assert counts["preempted"] > 0
        assert_clean(engine)
    assert results["swap"][0] == results["recompute"][0]
    assert results["swap"][2]["swap_out"] == results["swap"][2]["swap_in"] > 0
    assert results["swap"][1] == 4 * (tokens_each - 1)        # every token computed exactly once
    assert results["recompute"][1] > 4 * (tokens_each - 1)


def test_async_scheduling_discards_the_step_after_a_stop_and_equals_sync():
    """Stop tokens are only seen one step late: the stopped request's extra step is discarded."""
    rng = random.Random(11)
    model = random_ouro(rng, 11)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(2, 9))] for _ in range(6)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=tuple(range(0, 60, 3)))
              for _ in prompts]
    outs = {}
    for async_ in (False, True):
        engine = LLMEngine(model, CPU, EngineConfig(block_size=2, num_kv_blocks=60, max_num_seqs=4,
                                                    max_num_batched_tokens=6, async_scheduling=async_))
        outs[async_] = [(o.token_ids, o.finish_reason)
                        for o in run_engine(engine, prompts, params, arrive_every=1)]
        assert_clean(engine)
    assert outs[True] == outs[False]
    assert any(reason == "stop" and len(t) < 12 for t, reason in outs[True])


def test_async_seeded_sampling_equals_sync():
    rng = random.Random(2)
    model = random_ouro(rng, 2)
    prompts = [[rng.randrange(1, model.config.vocab_size) for _ in range(5)] for _ in range(3)]
    params = [SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=100 + i, ignore_eos=True)
              for i in range(3)]
    outs = {}
    for async_ in (False, True):
        engine = LLMEngine(model, CPU, EngineConfig(block_size=4, num_kv_blocks=64, async_scheduling=async_))
        outs[async_] = [o.token_ids for o in run_engine(engine, prompts, params, arrive_every=1)]
    assert outs[True] == outs[False]


def test_last_exited_early_exit_unchanged_by_async_prefix_and_wavefront():
    """With early exit, kv_mode=last_exited has its own semantics: the features must not change it."""
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32")
    with torch.no_grad():
        model.model.early_exit_gate.bias.fill_(1.5)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    prompts = [case.prompt(i) for i in range(case.num_prompts)] + [case.prompt(0)]
    outs = {}
    for features in ({}, dict(async_scheduling=True, enable_prefix_caching=True, wavefront_prefill=True)):
        engine = LLMEngine(model, CPU, EngineConfig(kv_mode="last_exited", block_size=4, num_kv_blocks=256,
                                                    max_num_batched_tokens=6, **features))
        outs[bool(features)] = [(o.token_ids, o.loops_per_token)
                                for o in run_engine(engine, prompts, [params] * len(prompts), arrive_every=2)]
    assert outs[True] == outs[False]
    assert min(min(loops) for _, loops in outs[True]) < model.default_num_loops      # tokens did exit early


def test_priority_experiment_high_priority_requests_finish_first():
    from examples.priority_experiment import SMALL_OURO, run_experiment

    model = zoo.from_config({**SMALL_OURO, "hidden_size": 32, "num_hidden_layers": 1, "total_ut_steps": 2},
                            dtype="float32", seed=0)
    medians = {}
    for policy in ("fcfs", "priority"):
        done = run_experiment(model, CPU, policy, num_low=16, num_high=4, num_slots=4, prompt_len=4,
                              max_tokens=6, high_arrival_step=2, num_kv_blocks=64)
        assert len(done["low"]) == 16 and len(done["high"]) == 4
        medians[policy] = {cls: sorted(c.steps for c in items)[len(items) // 2]
                           for cls, items in done.items()}
    print(f"median completion step by class: {medians}")
    assert medians["priority"]["high"] < medians["fcfs"]["high"]
    assert medians["priority"]["high"] < medians["priority"]["low"]
    assert medians["fcfs"]["high"] > medians["fcfs"]["low"]


def test_unsupported_combinations_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="prefix caching needs|enable_prefix_caching needs"):
        EngineConfig(kv_mode="shared", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="wavefront_prefill needs"):
        EngineConfig(kv_mode="shared", wavefront_prefill=True)
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    # Huginn's random initial state makes KV depend on more than the tokens: never shared
    model = zoo.from_pretrained(golden_case("huginn-tiny").path, dtype="float32")
    engine = LLMEngine(model, CPU, EngineConfig(block_size=4, num_kv_blocks=64, enable_prefix_caching=True))
    assert engine.add_request("r", [1, 2, 3], SamplingParams(seed=1)).cache_salt is None
    assert engine.add_request("z", [1, 2, 3], SamplingParams(init_scale=0.0)).cache_salt is not None
