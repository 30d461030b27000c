"""Where a Hal's attention backend takes no packed graphs (Ascend), a step that decodes and ends a
few prompts replays the captured decode pass and one captured prefill per prompt
(`ModelRunner.split_step`) instead of one eager pass, and the tokens stay those of the simple path:
requests joining a decoding batch, on the CPU with graphs=true and packed steps off (the padded
passes run eagerly; by default the CPU keeps its one packed pass) and on the simulated Ascend Hal
(its graphs replay what the start captured), every model family."""
import pytest
from helpers import count_step_kinds, golden_case, golden_names, single_thread  # noqa: F401 (fixture)

import hal
import zoo
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.execution import captured_steps
from runtime.execution.reference import generate_reference
from runtime.execution.runner import ModelRunner

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, init_scale=0.0)


@pytest.fixture(autouse=True)
def no_packed_steps(monkeypatch):
    """The split steps as a Hal runs them whose attention backend takes no packed graphs (Ascend's):
    on the others a packed pass runs these steps first (tests/runtime/test_packed_step.py)."""
    monkeypatch.setattr(ModelRunner, "packed_step", lambda self, scheduled: None)


@pytest.fixture
def step_kinds(monkeypatch):
    """Counts of the runner's step kinds: split, eager, captured decode, captured prefill."""
    return count_step_kinds(monkeypatch, ("split", "eager", "captured", "prefill"))


def join_while_decoding(engine, prompts, joins):
    """Start the first prompts, then add one more (`joins`: how many at once) after each step, so
    each joins requests that decode."""
    outputs, pending = {}, list(enumerate(prompts))
    for i, prompt in pending[:2]:
        engine.add_request(str(i), prompt, PARAMS)
    pending = pending[2:]
    while engine.has_unfinished_requests() or pending:
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o.token_ids
        if pending and engine.has_unfinished_requests():
            for i, prompt in pending[:joins]:
                engine.add_request(str(i), prompt, PARAMS)
            pending = pending[joins:]
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("name", golden_names())
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_joining_prompts_replay_captured_passes_and_keep_the_tokens(name, async_scheduling, step_kinds,
                                                                    single_thread):
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    prompts = [case.prompt(i % case.num_prompts)[: 3 + 2 * i] for i in range(6)]
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                                            async_scheduling=async_scheduling, graphs=True))
    got = join_while_decoding(engine, prompts, joins=1)
    want = [generate_reference(model, p, PARAMS)[0] for p in prompts]
    assert got == want
    assert step_kinds["split"] >= 3, step_kinds
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_on_a_hal_that_records_graphs_the_split_steps_replay_start_captures(step_kinds, single_thread):
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    prompts = [case.prompt(i % case.num_prompts)[: 4 + 3 * i] for i in range(6)]
    engine = LLMEngine(model, hal.get("ascend-sim", sim_any_shape=True),
                       EngineConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=64, graphs=True))
    at_start = dict(engine.runner.graphs.captured)
    got = join_while_decoding(engine, prompts, joins=2)
    assert got == [generate_reference(model, p, PARAMS)[0] for p in prompts]
    assert step_kinds["split"] >= 2 and engine.runner.graphs.captured == at_start, step_kinds


@pytest.mark.parametrize("name", golden_names())
@pytest.mark.parametrize("hal_name", ["cpu", "ascend-sim"])
def test_a_burst_of_chunked_prompts_replays_captured_prefills(name, hal_name, step_kinds, single_thread):
    """Prompts longer than the step's token budget, arriving at once: every step is chunks of them
    (most not their prompt's last, and no decodes at first), each run by a captured prefill whose
    logits only a last chunk samples; no step takes the eager pass, none captures anything past
    the start on a Hal that records graphs, and the tokens are the simple path's."""
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    prompts = [(case.prompt(i % case.num_prompts) * 8)[: 37 + 9 * i] for i in range(3)]
    sim = {"sim_any_shape": True} if hal_name == "ascend-sim" else {}
    engine = LLMEngine(model, hal.get(hal_name, **sim), EngineConfig(block_size=16, max_num_seqs=4,
                                                                      max_num_batched_tokens=32, graphs=True))
    at_start = dict(engine.runner.graphs.captured)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, PARAMS)
    outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert [outs[str(i)] for i in range(len(prompts))] == [generate_reference(model, p, PARAMS)[0] for p in prompts]
    assert step_kinds["eager"] == 0 and step_kinds["split"] >= 4, step_kinds
    if hal_name == "ascend-sim":
        assert engine.runner.graphs.captured == at_start
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_with_capture_turned_off_the_same_chunks_split_eagerly(step_kinds, monkeypatch, single_thread):
    """graphs=false on a Hal that captures (the simulated Ascend): a burst's steps still split, each
    chunk's padded pass run eagerly, so turning capture off to debug it changes no pass's shapes
    (one packed pass would round differently, and bf16 near-ties would flip)."""
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    prompts = [(case.prompt(i % case.num_prompts) * 8)[: 37 + 9 * i] for i in range(3)]
    got, splits = {}, {}
    for graphs in (True, False):
        engine = LLMEngine(model, hal.get("ascend-sim", sim_any_shape=True),
                           EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=32, graphs=graphs))
        assert engine.runner.graphs.capture is graphs
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, PARAMS)
        outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
        got[graphs] = [outs[str(i)] for i in range(len(prompts))]
        splits[graphs] = step_kinds["split"]
        assert step_kinds["eager"] == 0, step_kinds
        step_kinds["split"] = 0
    assert got[False] == got[True] == [generate_reference(model, p, PARAMS)[0] for p in prompts]
    assert splits[False] == splits[True] >= 4, splits


@pytest.mark.parametrize("hal_name", ["cpu", "ascend-sim"])
def test_a_lone_prompt_past_the_split_cap_replays_a_prefill_per_chunk(hal_name, step_kinds, monkeypatch,
                                                                      single_thread):
    """One prompt three budgets long, alone, with chunks wider than `MAX_SPLIT_TOKENS` (the engine's
    default budget of 2,048 against the cap of 1,024): every chunk, its last and the ones before
    (which sample nothing), replays its captured prefill, one pass a step, never the eager pass."""
    monkeypatch.setattr(captured_steps, "MAX_SPLIT_TOKENS", 8)
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    prompt = (case.prompt(0) * 20)[:3 * 32 + 5]
    sim = {"sim_any_shape": True} if hal_name == "ascend-sim" else {}
    engine = LLMEngine(model, hal.get(hal_name, **sim), EngineConfig(block_size=16, max_num_seqs=4,
                                                                      max_num_batched_tokens=32, graphs=True))
    engine.add_request("a", prompt, PARAMS)
    outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert outs["a"] == generate_reference(model, prompt, PARAMS)[0]
    assert step_kinds["prefill"] == 4 and step_kinds["eager"] == step_kinds["split"] == 0, step_kinds


@pytest.mark.parametrize("cap, max_tokens, path", [(6, 69, "split"), (5, 69, "eager"), (6, 68, "eager")])
def test_six_prompts_at_once_split_under_both_caps(cap, max_tokens, path, step_kinds, monkeypatch, single_thread):
    """Six prompts of 69 tokens in all arriving together make one step of six chunks: replayed one by
    one where `MAX_SPLIT_PROMPTS` is 6 or more and `MAX_SPLIT_TOKENS` 69 or more, otherwise one eager
    pass."""
    monkeypatch.setattr(captured_steps, "MAX_SPLIT_PROMPTS", cap)
    monkeypatch.setattr(captured_steps, "MAX_SPLIT_TOKENS", max_tokens)
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    prompts = [(case.prompt(i % case.num_prompts) * 4)[: 9 + i] for i in range(6)]
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, graphs=True))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, PARAMS)
    outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert [outs[str(i)] for i in range(6)] == [generate_reference(model, p, PARAMS)[0] for p in prompts]
    assert step_kinds[path] == 1 and step_kinds["split" if path == "eager" else "eager"] == 0, step_kinds


@pytest.mark.parametrize("cap, graphs, joins", [(1, True, 2), (None, None, 1)], ids=["over-the-cap", "cpu-default"])
def test_steps_that_may_not_split_run_one_eager_pass(cap, graphs, joins, step_kinds, monkeypatch, single_thread):
    """More joining prompts than `MAX_SPLIT_PROMPTS`; or the CPU by default, whose passes are not
    captured, where one packed pass reads the weights once and pads nothing."""
    if cap is not None:
        monkeypatch.setattr(captured_steps, "MAX_SPLIT_PROMPTS", cap)
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    prompts = [case.prompt(0)[: 3 + i] for i in range(6)]
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, graphs=graphs))
    assert join_while_decoding(engine, prompts, joins=joins) == [generate_reference(model, p, PARAMS)[0]
                                                                 for p in prompts]
    assert step_kinds["split"] == 0 and step_kinds["eager"] >= 2, step_kinds


def test_a_prompt_asking_for_prompt_logprobs_keeps_the_eager_pass(step_kinds, single_thread):
    """Its every prompt row's logits are wanted: the captured prefill samples only the last."""
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, graphs=True))
    engine.add_request("a", case.prompt(0)[:5], PARAMS)
    engine.step()
    engine.step()
    engine.add_request("b", case.prompt(0)[:7], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    outs = {o.request_id: o for o in engine.run_until_done()}
    assert step_kinds["split"] == 0 and step_kinds["eager"] >= 1, step_kinds
    assert outs["a"].token_ids == generate_reference(model, case.prompt(0)[:5], PARAMS)[0]


@pytest.mark.parametrize("a_tokens, path", [(6, "split"), (3, "prefill")])
def test_a_last_chunk_padded_past_its_blocks_fits_the_scratch_blocks(a_tokens, path, step_kinds, single_thread):
    """A 2-token last chunk at a block boundary, padded to the 16-token bucket, needs one scratch
    block; 16 scratch slots make one block of 32, which the padding check counted as none (found by
    a fuzzer once joining prompts took captured prefills). The chunk joins a's decode, or (a done)
    runs alone, as such a chunk did before."""
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(block_size=32, max_num_batched_tokens=16, max_num_seqs=2,
                                                            graphs=True))
    prompt = list(range(3, 35))            # chunks of 15, 15 (beside a's decodes) and 2 tokens
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=a_tokens, temperature=0.0, ignore_eos=True))
    engine.step()
    engine.add_request("b", prompt, PARAMS)
    outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert outs["b"] == generate_reference(model, prompt, PARAMS)[0]
    assert step_kinds[path] >= 1, step_kinds
