"""The engine captures its decode buckets and short prefills when it starts (`engine.capture_at_start`)
where the Hal records graphs, here the simulated Ascend Hal, whose graphs bake the host values of
the capture: the steps then replay those captures and capture nothing more, and the tokens are the
golden ones and those of an engine that captures each pass on first use."""
import pytest
from helpers import golden_case, single_thread  # noqa: F401 (fixture)

import hal
import zoo
from runtime import SamplingParams
from runtime.config import EngineConfig, SpeculativeConfig
from runtime.engine.llm_engine import LLMEngine


def engine_of(model, **config):
    defaults = dict(block_size=16, max_num_batched_tokens=64, max_num_seqs=4, graphs=True)
    return LLMEngine(model, hal.get("ascend-sim", sim_any_shape=True), EngineConfig(**{**defaults, **config}))


def generate(engine, case):
    params = SamplingParams(max_tokens=case.meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True,
                            num_loops=case.meta.get("greedy_num_steps"), init_scale=0.0)
    for i in range(case.num_prompts):
        engine.add_request(str(i), case.prompt(i), params)
    outputs = {o.request_id: o for o in engine.run_until_done()}
    return [outputs[str(i)].token_ids for i in range(case.num_prompts)]


@pytest.fixture(scope="module")
def case_and_model():
    case = golden_case("ouro-tiny")
    return case, zoo.from_pretrained(case.path, dtype="float32").eval()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_passes_captured_at_start_are_the_ones_steps_replay(case_and_model, async_scheduling, single_thread):
    case, model = case_and_model
    engine = engine_of(model, async_scheduling=async_scheduling)
    loops, planes = model.default_num_loops, engine.runner.layout.num_planes(model.default_num_loops)
    copies = (0, 1) if async_scheduling else (0,)
    decode = {("decode", bucket, loops, copy) for bucket in (1, 2, 4) for copy in copies}
    prefill = {("prefill", width, loops, planes, False, context) for width in (16, 32, 64) for context in (False, True)}
    captured = engine.runner.graphs.captured
    assert set(captured) == decode | prefill
    assert engine.runner.start_capture_s > 0
    at_start = dict(captured)

    assert generate(engine, case) == [case.greedy(i) for i in range(case.num_prompts)]
    assert captured == at_start                  # same keys, same captures: nothing captured later
    lazy = engine_of(model, async_scheduling=async_scheduling, capture_at_start=False)
    assert not lazy.runner.graphs.captured and lazy.runner.start_capture_s == 0
    assert generate(lazy, case) == [case.greedy(i) for i in range(case.num_prompts)]
    assert set(lazy.runner.graphs.captured) < set(at_start)
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_the_engines_default_depth_is_the_one_captured(case_and_model, single_thread):
    """engine.default_num_loops (the CLIs' model.num_loops): the passes captured at start are those
    of that depth, and requests that name no depth take it and replay them."""
    case, model = case_and_model
    engine = engine_of(model, default_num_loops=2)
    assert {key[2] for key in engine.runner.graphs.captured} == {2}
    at_start = dict(engine.runner.graphs.captured)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("0", case.prompt(0), params)
    (output,) = engine.run_until_done()
    assert engine.runner.graphs.captured == at_start
    reference = engine_of(model, capture_at_start=False)
    reference.add_request("0", case.prompt(0), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                              num_loops=2))
    assert output.token_ids == reference.run_until_done()[0].token_ids
    with pytest.raises(ValueError, match="default_num_loops=9 is above max_num_loops=8"):
        EngineConfig(default_num_loops=9, max_num_loops=8)


def test_a_speculating_engine_captures_the_plain_passes_too(case_and_model, single_thread):
    """Its steps replay plain decode passes as well (requests that do not speculate), beside verify
    passes and chains of their own, captured on first use."""
    _, model = case_and_model
    engine = engine_of(model, speculative=SpeculativeConfig(num_tokens=2, draft_loops=1))
    assert {key[0] for key in engine.runner.graphs.captured} == {"decode", "prefill"}


def test_only_the_prefill_widths_a_prompt_can_take_are_captured(case_and_model, single_thread):
    """A prompt of at most max_model_len tokens takes a width up to the first one that holds it."""
    _, model = case_and_model
    engine = engine_of(model, max_model_len=20)
    assert {key[1] for key in engine.runner.graphs.captured if key[0] == "prefill"} == {16, 32}


@pytest.mark.parametrize("max_model_len", [2, 3])
def test_a_context_shorter_than_the_batch_captures_at_start(case_and_model, max_model_len, single_thread):
    """The padding rows of the 4-row decode bucket start inside a scratch block, up to 4 tokens long:
    past a 2- or 3-token context, which the metadata capacity once took as the longest sequence
    ("batch exceeds the meta capacity", found by a fuzzer)."""
    _, model = case_and_model
    engine = engine_of(model, max_model_len=max_model_len, num_kv_blocks=64)
    assert ("decode", 4, model.default_num_loops, 0) in engine.runner.graphs.captured
    for i in range(4):
        engine.add_request(str(i), [1 + i] * (max_model_len - 1), SamplingParams(max_tokens=1, temperature=0.0))
    assert [len(o.token_ids) for o in engine.run_until_done()] == [1] * 4


def test_nothing_is_captured_at_start_where_the_hal_records_no_graphs(case_and_model):
    """On the CPU the padded path runs eagerly: capturing at start would only run every bucket once."""
    _, model = case_and_model
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(max_num_seqs=4, graphs=True))
    assert not engine.runner.graphs.captured


def test_capture_at_start_must_be_a_bool():
    with pytest.raises(ValueError, match="capture_at_start must be true or false"):
        EngineConfig(capture_at_start="no")
