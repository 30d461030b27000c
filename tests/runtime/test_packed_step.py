"""A step of prompt chunks with or without decodes replays one packed pass (padded to a multiple of
`PACKED_GRANULE` tokens and `max_num_seqs + 1` sequences) instead of split or eager passes, and the
tokens stay those of the simple path: every model family, with and without async scheduling, on
the CPU with graphs=true (the padded pass runs eagerly, as a Hal that captures would replay it)."""
import numpy as np
import pytest
import torch
from helpers import count_step_kinds, golden_case, golden_names, single_thread  # noqa: F401 (fixture)

import hal
import zoo
from hal.common.paged import slot_mapping
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.execution import captured_steps
from runtime.execution.packed_steps import PACKED_GRANULE, PackedShape, pad_packed
from runtime.execution.reference import generate_reference
from runtime.execution.step_inputs import HostInputs, PassEnv
from hal.attention import PagedBatch

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, init_scale=0.0)


@pytest.fixture
def packed_steps(monkeypatch):
    """How many steps ran packed, and how many eagerly."""
    return count_step_kinds(monkeypatch, ("packed", "eager"))


@pytest.mark.parametrize("name", golden_names())
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_burst_beside_decodes_replays_packed_passes_and_keeps_the_tokens(name, async_scheduling, packed_steps,
                                                                          monkeypatch, single_thread):
    """Two requests decode while four longer prompts arrive: each step of two or more of their
    chunks beside those decodes is a packed pass (a lone chunk splits, or here, wider than the
    budget's prefill buckets, runs eagerly)."""
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    prompts = [(case.prompt(i % case.num_prompts) * 6)[: 5 + 11 * i] for i in range(6)]
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(max_num_seqs=8, max_num_batched_tokens=40,
                                                            async_scheduling=async_scheduling, graphs=True))
    for i, prompt in enumerate(prompts[:2]):
        engine.add_request(str(i), prompt, PARAMS)
    engine.step()
    engine.step()
    for i, prompt in enumerate(prompts[2:], start=2):
        engine.add_request(str(i), prompt, PARAMS)
    outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert [outs[str(i)] for i in range(len(prompts))] == [generate_reference(model, p, PARAMS)[0] for p in prompts]
    assert packed_steps["packed"] >= 3, packed_steps
    assert any(key[0] == "packed" for key in engine.runner.graphs.captured)
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_pass_captured_over_a_burst_keeps_none_of_its_requests(single_thread):
    """A packed pass is captured over the batch of its token count's second step: once those requests
    finish and the engine forgets them, nothing holds them (the captured context keeps no draws)."""
    import gc
    import weakref

    case = golden_case("huginn-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, graphs=True))
    requests = [engine.add_request(str(i), (case.prompt(0) * 8)[:40 + i], PARAMS) for i in range(4)]
    refs = [weakref.ref(r) for r in requests]
    del requests
    engine.run_until_done()
    assert any(key[0] == "packed" for key in engine.runner.graphs.captured)
    engine.add_request("after", case.prompt(1), PARAMS)      # the scheduler keeps its last step's plan
    engine.run_until_done()
    gc.collect()
    assert [ref() for ref in refs] == [None] * 4


def test_steps_the_packed_pass_does_not_take_stay_eager(packed_steps, monkeypatch, single_thread):
    """Prompt logprobs (every prompt row's logits) and requests at different depths keep the eager
    pass (past the split caps, set low here)."""
    monkeypatch.setattr(captured_steps, "MAX_SPLIT_TOKENS", 4)
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, graphs=True))
    engine.add_request("a", case.prompt(0)[:6], PARAMS)
    engine.add_request("b", case.prompt(0)[:7], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1))
    engine.run_until_done()
    assert packed_steps == {"packed": 0, "eager": 1}, packed_steps
    deeper = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, num_loops=model.default_num_loops + 1)
    engine.add_request("c", case.prompt(0)[:6], PARAMS)
    engine.add_request("d", case.prompt(0)[:7], deeper)
    outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert packed_steps["packed"] == 0 and packed_steps["eager"] >= 2, packed_steps
    assert outs["d"] == generate_reference(model, case.prompt(0)[:7], deeper)[0]


def _env(block_size=4, scratch_block=50, num_scratch_slots=PACKED_GRANULE):
    return PassEnv(None, None, None, [], None, torch.device("cpu"), torch.float32, block_size, scratch_block,
                   num_scratch_slots)


def test_padding_is_one_sequence_in_the_scratch_blocks_and_empty_ones():
    """Two real sequences (a 5-token chunk after 3 cached tokens, a decode) padded to 16 tokens and
    4 sequences: one padding sequence of 10 tokens at positions 0-9 of the scratch blocks, one
    without tokens; the real rows' slots and tables unchanged."""
    tables = [[[1, 2], [7, 8, 9]], [[3, 4], [10, 11, 12]]]                     # [plane][seq][block]
    batch = PagedBatch([5, 1], [8, 9], tables, 4)
    host = HostInputs(list(range(1, 7)), [(5, "b")], np.array([3, 4, 5, 6, 7, 8]), batch, [("a", 5), ("b", 1)])
    full = pad_packed(host, PackedShape(4, 16), _env())
    assert list(full.batch.query_lens) == [5, 1, 10, 0] and list(full.batch.seq_lens) == [8, 9, 10, 0]
    assert list(full.positions) == [3, 4, 5, 6, 7, 8, *range(10)]
    assert list(full.token_ids) == [1, 2, 3, 4, 5, 6] + [0] * 10 and full.fed == [(5, "b")]
    assert full.draws[2:] == [(None, 10), (None, 0)]
    slots = slot_mapping(full.batch)
    want_real = slot_mapping(batch)
    assert np.array_equal(slots[:, :6], want_real)
    assert np.array_equal(slots[:, 6:], np.tile(np.arange(50 * 4, 50 * 4 + 10), (2, 1)))
    with pytest.raises(AssertionError):
        pad_packed(host, PackedShape(2, 16), _env())                # no room for a padding sequence



@pytest.mark.parametrize("name", golden_names())
def test_a_long_prompt_joining_decodes_splits_past_the_token_cap(name, monkeypatch, single_thread):
    """A prompt three budgets long joins two decoding requests: each step of one of its chunks beside
    the decodes replays the decode pass and the chunk's prefill (packed passes take two or more
    chunks), though the chunk is past `MAX_SPLIT_TOKENS` (a lone chunk splits up to
    `MAX_SPLIT_TOKENS_ONE_CHUNK`); tokens unchanged."""
    monkeypatch.setattr(captured_steps, "MAX_SPLIT_TOKENS", 8)
    kinds = count_step_kinds(monkeypatch, ("packed", "split", "eager"))
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32").eval()
    decoding = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, init_scale=0.0)
    short = [case.prompt(0)[:5], case.prompt(1 % case.num_prompts)[:7]]
    long = (case.prompt(0) * 40)[: 3 * 32 + 4]
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, graphs=True))
    for i, prompt in enumerate(short):
        engine.add_request(str(i), prompt, decoding)
    engine.step()
    engine.step()
    engine.add_request("long", long, PARAMS)
    outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert outs["long"] == generate_reference(model, long, PARAMS)[0]
    assert outs["0"] == generate_reference(model, short[0], decoding)[0]
    assert kinds["split"] >= 4 and kinds["eager"] == 0, kinds
