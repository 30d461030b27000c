"""Decode steps and lone prompts (or their chunks) of requests with early exit (`exit_threshold < 1`,
Ouro's gate) replay captured passes where every loop runs anyway (kv_mode=full): the pass keeps each
loop's state and gate of the rows it samples, chooses each row's exit loop on the device from static
per-row settings, and hands back the loops with the tokens. Tokens and loops per token equal the
simple path's, rows joining and leaving (so the settings change between replays), sync and async, on the CPU and on the simulated Ascend Hal
(whose graphs keep the host values of their capture: a setting read on the host would go stale)."""
import pytest
import torch
from helpers import count_step_kinds, golden_case, single_thread  # noqa: F401 (fixture)

import hal
import zoo
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.execution.reference import generate_reference

SETTINGS = [(0.5, 1, 9), (0.9, 2, 4), (1.0, 1, 6), (0.3, 1, 7), (0.7, 3, 5)]   # threshold, min_loops, max_tokens


def assert_simple_path(model, prompts, params, outs) -> None:
    """Each request's tokens and loops per token are the simple path's."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        tokens, _, loops = generate_reference(model, prompt, p)
        assert (outs[str(i)].token_ids, outs[str(i)].loops_per_token) == (tokens, loops), i


@pytest.fixture(scope="module")
def case_and_model():
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    with torch.no_grad():
        model.model.early_exit_gate.bias.fill_(1.0)        # gates that exit at different loops
    return case, model


@pytest.mark.parametrize("hal_name", ["cpu", "ascend-sim"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_early_exit_decodes_replay_captured_passes(case_and_model, hal_name, async_scheduling, monkeypatch,
                                                   single_thread):
    """Requests with different exit settings join one after each step (each join a split step: the
    exit decode pass and the chunk's exit prefill), so the rows' settings change between replays."""
    case, model = case_and_model
    kinds = count_step_kinds(monkeypatch, ("captured", "split", "eager"))
    sim = {"sim_any_shape": True} if hal_name == "ascend-sim" else {}
    engine = LLMEngine(model, hal.get(hal_name, **sim), EngineConfig(max_num_seqs=4, graphs=True,
                                                                      async_scheduling=async_scheduling))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, exit_threshold=t, min_loops=m)
              for t, m, n in SETTINGS]
    prompts = [case.prompt(i % case.num_prompts)[: 3 + 2 * i] for i in range(len(SETTINGS))]
    outs = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):   # one joins after each step: rows change
        engine.add_request(str(i), prompt, p)
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    outs.update({o.request_id: o for o in engine.run_until_done()})
    assert_simple_path(model, prompts, params, outs)
    assert any(min(outs[str(i)].loops_per_token) < model.default_num_loops for i in range(len(SETTINGS)))
    assert any(key[0] == "decode_exit" for key in engine.runner.graphs.captured)
    assert kinds["captured"] >= 4 and kinds["split"] >= 3 and kinds["eager"] == 0, kinds


@pytest.mark.parametrize("hal_name", ["cpu", "ascend-sim"])
def test_a_lone_prompt_with_early_exit_replays_its_captured_prefills(case_and_model, hal_name, monkeypatch,
                                                                     single_thread):
    """Prompts one at a time, some longer than the budget (chunks with and without context): every
    step replays a captured pass (the last chunk's chooses the exit loop), none runs eagerly."""
    case, model = case_and_model
    kinds = count_step_kinds(monkeypatch, ("prefill", "captured", "eager"))
    sim = {"sim_any_shape": True} if hal_name == "ascend-sim" else {}
    engine = LLMEngine(model, hal.get(hal_name, **sim), EngineConfig(max_num_seqs=4, graphs=True,
                                                                      max_num_batched_tokens=16))
    for i, (threshold, min_loops, _) in enumerate(SETTINGS[:4]):
        prompt = (case.prompt(i % case.num_prompts) * 4)[: 5 + 9 * i]
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, exit_threshold=threshold,
                                min_loops=min_loops)
        engine.add_request(str(i), prompt, params)
        out = engine.run_until_done()[0]
        tokens, _, loops = generate_reference(model, prompt, params)
        assert (out.token_ids, out.loops_per_token) == (tokens, loops), i
    assert {key[0] for key in engine.runner.graphs.captured} >= {"prefill_exit", "decode_exit"}
    assert kinds["eager"] == 0 and kinds["prefill"] >= 6, kinds


def test_modes_that_stop_early_keep_the_eager_pass(case_and_model, monkeypatch, single_thread):
    """kv_mode=last_exited: an exiting token skips its later loops, a per-row decision inside the
    step, so its decode steps stay eager."""
    case, model = case_and_model
    kinds = count_step_kinds(monkeypatch, ("captured", "eager"))
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(max_num_seqs=4, graphs=True, kv_mode="last_exited"))
    assert not engine.runner.captures_exits
    engine.add_request("a", case.prompt(0), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                           exit_threshold=0.5))
    engine.run_until_done()
    assert kinds["captured"] == 0 and kinds["eager"] == 4, kinds


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_burst_with_early_exit_replays_packed_passes(case_and_model, async_scheduling, monkeypatch, single_thread):
    """Prompts arriving together, chunked over a small budget beside decodes, with early exit: the
    steps of two or more chunks replay packed passes that choose their sampled rows' exit loops."""
    case, model = case_and_model
    kinds = count_step_kinds(monkeypatch, ("packed", "eager"))
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(max_num_seqs=8, graphs=True, max_num_batched_tokens=24,
                                                            async_scheduling=async_scheduling))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, exit_threshold=t, min_loops=m)
              for t, m, n in SETTINGS]
    prompts = [(case.prompt(i % case.num_prompts) * 4)[: 7 + 5 * i] for i in range(len(SETTINGS))]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt, p)
    outs = {o.request_id: o for o in engine.run_until_done()}
    assert_simple_path(model, prompts, params, outs)
    assert kinds["packed"] >= 2 and kinds["eager"] == 0, kinds
    assert any(key[0] == "packed_exit" for key in engine.runner.graphs.captured)
