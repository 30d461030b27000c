"""The batch sampler (runtime/execution/sampler.py) against plain per-row reference computations on
the logits: penalties, logit_bias and min_tokens as the OpenAI docs describe them, the filters, keyed
seeded noise that ignores the rest of the batch, and the engine's knobs end to end."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

import hal
import zoo
from helpers import golden_case, single_thread  # noqa: F401 (fixture)
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.engine.llm_engine import LLMEngine
from runtime.execution.reference import generate_reference
from runtime.execution.sampler import (SamplingTensors, apply_processors, filtered_probs, probabilities, sample,
                                       sample_token)

pytestmark = pytest.mark.usefixtures("single_thread")


class Row(NamedTuple):
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids: tuple[int, ...] = ()
    request_id: str = "r"


def reference_processors(logits: torch.Tensor, row: Row) -> torch.Tensor:
    """One row, written out token by token as the OpenAI / vLLM docs describe each knob."""
    out, p = logits.clone().double(), row.params
    for token, bias in p.logit_bias:
        out[token] += bias
    if len(row.output_token_ids) < p.min_tokens:
        for token in set(p.stop_token_ids) | set(row.stop_token_ids):
            out[token] = -math.inf
    seen = set(row.prompt_token_ids) | set(row.output_token_ids)
    for token in range(out.shape[0]):
        if token in seen and p.repetition_penalty != 1:
            out[token] = out[token] / p.repetition_penalty if out[token] > 0 else out[token] * p.repetition_penalty
        count = row.output_token_ids.count(token)
        out[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def random_row(rng: random.Random, vocab: int) -> Row:
    params = SamplingParams(
        max_tokens=50, temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 3, 50]),
        top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0.0, 0.0, 0.2]),
        presence_penalty=rng.choice([0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.3, 2.0]), repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        logit_bias={rng.randrange(vocab): rng.uniform(-100, 100) for _ in range(rng.randrange(3))},
        min_tokens=rng.choice([0, 5]), stop_token_ids=[rng.randrange(vocab)], seed=rng.randrange(1000))
    return Row(params, [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))],
               [rng.randrange(vocab) for _ in range(rng.randrange(8))], (rng.randrange(vocab),))


@pytest.mark.parametrize("seed", range(4))
def test_processors_equal_the_per_row_reference(seed):
    rng = random.Random(seed)
    vocab = 40
    rows = [random_row(rng, vocab) for _ in range(9)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed)) * 4
    got = apply_processors(logits, SamplingTensors.build(rows, torch.device("cpu"), vocab))
    for i, row in enumerate(rows):
        want = reference_processors(logits[i], row)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want))
        finite = ~torch.isinf(want)
        torch.testing.assert_close(got[i][finite].double(), want[finite], atol=1e-4, rtol=1e-5)


def test_a_requests_cached_prompt_array_gives_the_same_penalties_as_its_list():
    from runtime.engine.sequence import Request
    rows = [Row(SamplingParams(temperature=0, repetition_penalty=1.5 + i), [3, 7, 7, i], [1, 2]) for i in range(3)]
    requests = [Request(f"r{i}", list(r.prompt_token_ids), r.params, num_loops=1, exit_threshold=1.0, num_planes=1,
                        output_token_ids=list(r.output_token_ids)) for i, r in enumerate(rows)]
    assert requests[2].prompt_array.tolist() == [3, 7, 7, 2] and requests[2].prompt_array is requests[2].prompt_array
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    cpu = torch.device("cpu")
    want = apply_processors(logits, SamplingTensors.build(rows, cpu, 8))
    assert torch.equal(apply_processors(logits, SamplingTensors.build(requests, cpu, 8)), want)
    assert not torch.equal(want, logits)


def test_penalties_and_bias_act_as_documented():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    row = lambda **kw: Row(SamplingParams(temperature=0, **kw), [3], [1, 1, 2])       # noqa: E731
    t = lambda r: apply_processors(logits, SamplingTensors.build([r], torch.device("cpu"), 4))[0].tolist()  # noqa: E731
    assert t(row(frequency_penalty=0.5)) == [2.0, 0.0, -1.5, 0.5]            # 1 seen twice, 2 once
    assert t(row(presence_penalty=0.5)) == [2.0, 0.5, -1.5, 0.5]
    assert t(row(repetition_penalty=2.0)) == [2.0, 0.5, -2.0, 0.25]          # prompt token 3 too
    assert t(row(logit_bias={0: -100, 2: 50})) == [-98.0, 1.0, 49.0, 0.5]
    banned = t(Row(SamplingParams(min_tokens=4, stop_token_ids=[0]), [3], [1, 1, 2], (3,)))
    assert banned[0] == banned[3] == -math.inf and banned[1:3] == [1.0, -1.0]
    assert t(Row(SamplingParams(min_tokens=3, stop_token_ids=[0]), [3], [1, 1, 2])) == logits[0].tolist()


def test_a_top_p_that_rounds_to_zero_keeps_the_top_token():
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.0]])
    one = torch.ones(1)
    probs = probabilities(logits, one, torch.zeros(1, dtype=torch.long), torch.zeros(1), use_top_k=False)
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="temperature must be a number in"):
        SamplingParams(temperature=1e39)
    with pytest.raises(ValueError, match="repetition_penalty must be in"):
        SamplingParams(repetition_penalty=float("inf"))


EXTREMES = {"temperature": [0.0, 1e-5, 0.5, 1.0, 1e30, 3.4e38], "top_p": [1e-300, 1e-8, 0.3, 1.0],
            "top_k": [0, 1, 3, 2 ** 31 - 1], "min_p": [0.0, 1e-300, 0.5, 1.0],
            "repetition_penalty": [1.2e-38, 1e-10, 0.5, 1.0, 2.0, 1e30, 3.4e38],
            "presence_penalty": [-2.0, 0.0, 2.0], "frequency_penalty": [-2.0, 2.0], "seed": [None, 1]}


def test_extreme_settings_never_pick_a_banned_token_or_a_nan():
    """Every combination of settings at float32's edges (and logits up to 1e30): the token is one
    the processors left finite (never a min_tokens-banned or -inf one), greedy rows take the
    argmax, and the processed logits hold no NaN. Found by a fuzz: a repetition penalty that rounds
    to 0 turned a banned -inf into NaN, and penalised logits past float32 made softmax NaN."""
    rng, vocab = random.Random(0), 16
    for trial in range(300):
        settings = {name: rng.choice(values) for name, values in EXTREMES.items()}
        stop = rng.randrange(vocab)
        params = SamplingParams(**settings, min_tokens=5, stop_token_ids=[stop],
                                logit_bias={rng.randrange(vocab): rng.choice([-100.0, 100.0])})
        row = Row(params, [rng.randrange(vocab) for _ in range(4)], [rng.randrange(vocab) for _ in range(3)])
        logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(trial)) * rng.choice([1, 1e4, 1e30])
        tensors = SamplingTensors.build([row], torch.device("cpu"), vocab)
        processed = apply_processors(logits, tensors)[0]
        token = int(sample(logits, tensors)[0])
        assert not processed.isnan().any() and token != stop and processed[token] > float("-inf"), (settings, token)
        if params.is_greedy:
            assert token == int(processed.argmax()), settings
    # every logit negative and seen, a penalty at float32's top: they stop at -3.4e38, the banned one stays -inf
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, repetition_penalty=3.4e38, min_tokens=5, stop_token_ids=[0])
        tensors = SamplingTensors.build([Row(params, [0, 1, 2, 3], [])], torch.device("cpu"), 4)
        assert all(int(sample(torch.tensor([[-5.0, -2.0, -3.0, -4.0]]), tensors)[0]) != 0 for _ in range(20))


def test_a_temperature_below_1e_5_is_greedy():
    """logits / 1e-40 overflow to inf and softmax gives NaN (the sampler then picked token 0)."""
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    for temperature in (1e-6, 1e-39, 1e-42):
        params = SamplingParams(temperature=temperature, seed=0)
        assert params.is_greedy and params.temperature == 0.0
        assert sample_token(logits, params) == 1
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_filters_match_the_single_request_distribution():
    rng = random.Random(0)
    vocab = 30
    rows = [random_row(rng, vocab) for _ in range(12)]
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(1)) * 3
    t = SamplingTensors.build(rows, torch.device("cpu"), vocab)
    assert t.any_min_p
    probs = probabilities(logits, t.temperature, t.top_k, t.top_p, min_p=t.min_p)
    for i, row in enumerate(rows):
        if row.params.is_greedy:
            continue
        torch.testing.assert_close(probs[i], filtered_probs(logits[i], row.params))
        kept = probs[i] > 0
        if 0 < row.params.top_k < vocab:
            assert kept.sum() <= row.params.top_k
        if row.params.min_p:               # every kept token at least min_p x the top one, before top-k/p
            plain = torch.softmax(logits[i] / row.params.temperature, -1)
            assert (plain[kept] >= row.params.min_p * plain.max()).all()
        assert torch.isclose(probs[i].sum(), torch.tensor(1.0))


def test_a_seeded_row_ignores_the_rest_of_the_batch():
    vocab = 50
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(2))
    rows = [Row(SamplingParams(temperature=1.0, seed=s), [1, 2], [3] * s) for s in range(6)]
    alone = [int(sample(logits[i:i + 1], SamplingTensors.build([rows[i]], torch.device("cpu"), vocab)))
             for i in range(6)]
    together = sample(logits, SamplingTensors.build(rows, torch.device("cpu"), vocab)).tolist()
    shuffled = sample(logits.flip(0), SamplingTensors.build(rows[::-1], torch.device("cpu"), vocab)).tolist()
    assert alone == together == shuffled[::-1]
    assert sample_token(logits[2], rows[2].params, rows[2].prompt_token_ids, rows[2].output_token_ids) == alone[2]


def test_keyed_noise_draws_from_the_distribution():
    """Chi-square over a 5-token vocabulary: the first sampled token of 4000 seeds follows p."""
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    p = torch.softmax(logits, -1)
    rows = [Row(SamplingParams(temperature=1.0, seed=s), [7], []) for s in range(4000)]
    tokens = sample(logits.expand(len(rows), -1), SamplingTensors.build(rows, torch.device("cpu"), 5))
    counts = torch.bincount(tokens, minlength=5).double()
    expected = p.double() * len(rows)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.5, (chi2, counts.tolist())                   # p = 0.001 at 4 degrees of freedom


# ----- end to end ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    return zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")


def run_engine(model, params_list, prompts, **options):
    options.setdefault("num_kv_blocks", 256)
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(**options))
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        engine.add_request(str(i), prompt, params)
    outs = {o.request_id: o for o in engine.run_until_done()}
    engine.blocks.check_invariants()
    return [outs[str(i)] for i in range(len(prompts))]


def test_keyed_initial_state_normals_are_truncated_standard_normals():
    from runtime.execution.keyed_random import keyed_exponentials, keyed_truncated_normals

    positions = torch.arange(4000)
    x = keyed_truncated_normals(7, positions, 64)
    assert x.shape == (4000, 64) and x.abs().max() <= 3.0001
    assert abs(x.mean().item()) < 0.01 and abs(x.std().item() - 0.9866) < 0.01      # N(0, 1) cut at 3
    assert torch.equal(x[100:110], keyed_truncated_normals(7, positions[100:110], 64))
    assert not torch.equal(x, keyed_truncated_normals(8, positions, 64))
    noise = keyed_exponentials(torch.full((4000,), 7), positions, 64)     # the sampler's stream, not reused
    assert abs(torch.corrcoef(torch.stack([x.flatten(), noise.flatten()]))[0, 1].item()) < 0.01

def test_min_p_keeps_the_tokens_at_least_min_p_times_as_likely_as_the_top_one():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    cpu = torch.device("cpu")
    t = SamplingTensors.build([Row(SamplingParams(temperature=1.0, min_p=0.3), [1], [])], cpu, 5)
    assert t.any_min_p and t.min_p.tolist() == [pytest.approx(0.3)]
    probs = probabilities(logits, t.temperature, t.top_k, t.top_p, min_p=t.min_p)[0]
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.2, 0.15, 0.0, 0.0]) / 0.85)   # 0.1 < 0.3 x 0.5
    everything = SamplingTensors.build([Row(SamplingParams(temperature=1.0, min_p=1.0), [1], [])],
                                       torch.device("cpu"), 5)
    assert probabilities(logits, everything.temperature, everything.top_k, everything.top_p,
                         min_p=everything.min_p)[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert not SamplingTensors.build([Row(SamplingParams(temperature=0.0, min_p=0.5), [1], [])],
                                     torch.device("cpu"), 5).any_min_p       # greedy: no filter
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        SamplingParams(min_p=1.5)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_p_rows_in_the_persistent_batch_equal_the_simple_path(tiny, async_scheduling):
    """Rows with min_p and no penalties sample from the persistent batch's gathered settings
    (runtime/execution/row_sampling.py): the reference path's tokens."""
    case = golden_case("ouro-tiny")
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=t, min_p=m, top_p=tp, seed=s)
              for t, m, tp, s in [(1.0, 0.1, 1.0, 3), (1.5, 0.05, 0.9, 4), (0.0, 0.5, 1.0, 5),
                                  (2.0, 0.0, 1.0, 6)]]
    prompts = [case.prompt(i % case.num_prompts) for i in range(len(params))]
    outs = run_engine(tiny, params, prompts, async_scheduling=async_scheduling)
    for out, prompt, p in zip(outs, prompts, params):
        assert out.token_ids == generate_reference(tiny, prompt, p)[0]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_knobs_equal_the_simple_path(tiny, async_scheduling):
    """Penalties, bias, min_tokens and seeded sampling in one batch give the reference path's tokens,
    also with async scheduling (penalties read the token still on the device)."""
    case = golden_case("ouro-tiny")
    rng = random.Random(5)
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=t, seed=rng.randrange(100),
                             repetition_penalty=rp, frequency_penalty=fp, presence_penalty=pp,
                             logit_bias={rng.randrange(100): 5.0}, min_tokens=mt, stop_token_ids=[s])
              for t, rp, fp, pp, mt, s in [(0.0, 1.3, 0.0, 0.0, 0, 7), (0.8, 1.0, 1.0, 0.5, 4, 3),
                                           (1.0, 0.9, 0.0, 1.5, 10, 11), (0.0, 1.0, 2.0, 0.0, 2, 5)]]
    prompts = [case.prompt(i % case.num_prompts) for i in range(len(params))]
    outs = run_engine(tiny, params, prompts, async_scheduling=async_scheduling)
    for out, prompt, p in zip(outs, prompts, params):
        tokens, reason, _ = generate_reference(tiny, prompt, p)
        assert out.token_ids == tokens and out.finish_reason == reason
        assert p.stop_token_ids[0] not in out.token_ids[:p.min_tokens - 1]


def test_logit_bias_forces_and_forbids_tokens(tiny):
    case = golden_case("ouro-tiny")
    greedy = case.greedy(0)
    forced, forbidden = run_engine(tiny, [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={42: 100}),
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={greedy[0]: -100})],
        [case.prompt(0)] * 2)
    assert forced.token_ids == [42] * 6
    assert forbidden.token_ids[0] != greedy[0]


def test_logprobs_are_the_models_log_softmax(tiny):
    """Sampled-token and prompt logprobs equal log_softmax of a dense forward, also with chunked
    prefill and with early exit (the exit loop's logits)."""
    case = golden_case("ouro-tiny")
    prompt = case.prompt(1)
    p = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for options in (dict(), dict(max_num_batched_tokens=5)):
        (out,) = run_engine(tiny, [p], [prompt], **options)
        ids = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            full = torch.log_softmax(tiny(ids).logits[0].float(), -1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for i, lp in enumerate(out.prompt_logprobs[1:], start=1):
            assert lp.token_id == prompt[i] and abs(lp.logprob - float(full[i - 1, prompt[i]])) < 1e-4
            assert len(lp.top) == 2 and lp.top[0][0] == int(full[i - 1].argmax())
            assert lp.rank == int((full[i - 1] > full[i - 1, prompt[i]]).sum()) + 1
        for j, lp in enumerate(out.logprobs):
            row = full[len(prompt) + j - 1]
            assert lp.token_id == out.token_ids[j] and lp.rank == 1 and len(lp.top) == 3
            assert abs(lp.logprob - float(row.max())) < 1e-4
    for lp in out.prompt_logprobs[1:] + out.logprobs:        # vLLM's shape: token id -> Logprob
        assert list(lp)[0] == lp.token_id and lp[lp.token_id] == (lp.logprob, lp.rank, None)
        assert [lp[t].rank for t, _ in lp.top] == list(range(1, len(lp.top) + 1))
        assert [lp[t].logprob for t, _ in lp.top] == [v for _, v in lp.top]
        assert len(lp) == len({lp.token_id, *(t for t, _ in lp.top)}) and dict(lp.items())
    absent = next(t for t in range(4) if t not in out.logprobs[0])    # a tuple field before: no KeyError
    with pytest.raises(KeyError):
        out.logprobs[0][absent]
    early = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0, exit_threshold=0.5)
    (out,) = run_engine(tiny, [early], [prompt])
    assert [lp.rank for lp in out.logprobs] == [1] * 4 and all(lp.logprob <= 0 for lp in out.logprobs)


def test_n_samples_share_the_prompt_and_follow_their_seeds(tiny):
    case = golden_case("ouro-tiny")
    prompt = case.prompt(0) * 3                                         # a few full blocks of 16
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True)
    (out,) = run_engine(tiny, [p], [prompt], block_size=16)
    assert len(out.outputs) == 3 and [s.index for s in out.outputs] == [0, 1, 2]
    assert len({tuple(s.token_ids) for s in out.outputs}) == 3
    assert out.token_ids == out.outputs[0].token_ids
    (single,) = run_engine(tiny, [SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)],
                           [prompt], block_size=16)
    assert single.token_ids == out.outputs[0].token_ids                # sample 0 keeps the request's seed
    (again,) = run_engine(tiny, [p], [prompt], block_size=16, max_num_seqs=2)
    assert [s.token_ids for s in again.outputs] == [s.token_ids for s in out.outputs]
    # greedy samples are equal; forked samples reuse the prompt's full blocks
    engine = LLMEngine(tiny, hal.get("cpu"), EngineConfig(num_kv_blocks=256, block_size=4))
    engine.add_request("g", prompt, SamplingParams(max_tokens=3, temperature=0, n=2, ignore_eos=True))
    (g,) = engine.run_until_done()
    assert g.outputs[0].token_ids == g.outputs[1].token_ids
    assert engine.num_computed_tokens == len(prompt) + 3 + 2 * 2     # the fork computes 3 of 15 prompt tokens
    engine.blocks.check_invariants()


def test_best_of_returns_the_n_most_likely_samples(tiny):
    case = golden_case("ouro-tiny")
    p = SamplingParams(max_tokens=6, temperature=1.5, seed=11, n=2, best_of=5, ignore_eos=True)
    (out,) = run_engine(tiny, [p], [case.prompt(1)])
    assert len(out.outputs) == 2 and out.logprobs is None
    (pool,) = run_engine(tiny, [SamplingParams(max_tokens=6, temperature=1.5, seed=11, n=5, logprobs=0,
                                               ignore_eos=True)], [case.prompt(1)])
    means = sorted((s.cumulative_logprob / len(s.token_ids), s.token_ids) for s in pool.outputs)[::-1]
    assert [s.token_ids for s in out.outputs] == [tokens for _, tokens in means[:2]]


def test_n_with_one_token_and_abort_leave_no_blocks(tiny):
    case = golden_case("ouro-tiny")
    engine = LLMEngine(tiny, hal.get("cpu"), EngineConfig(num_kv_blocks=256, block_size=4))
    engine.add_request("a", case.prompt(0), SamplingParams(max_tokens=1, n=4, seed=0))
    engine.add_request("b", case.prompt(1), SamplingParams(max_tokens=30, n=3, seed=1, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests() and not any(o.request_id == "a" and o.finished for o in outs):
        outs += engine.step()
    engine.abort("b")
    outs += engine.run_until_done()
    (a,) = [o for o in outs if o.request_id == "a" and o.finished]
    assert len(a.outputs) == 4 and all(len(s.token_ids) == 1 for s in a.outputs)
    assert not engine.has_unfinished_requests() and not engine.groups
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.blocks.check_invariants()


def test_sample_ids_of_a_live_group_are_kept_and_a_cut_short_sample_is_never_the_best(tiny):
    """Samples fork under "<id>#<i>": an id a live group will fork is refused (it used to be taken,
    and the fork then failed mid-step on its blocks), other ids with '#' are fine; with best_of > n an
    aborted sample ranks after every complete one, whatever its few tokens' mean logprob."""
    case = golden_case("ouro-tiny")
    engine = LLMEngine(tiny, hal.get("cpu"), EngineConfig(num_kv_blocks=256, block_size=4))
    engine.add_request("a", case.prompt(0), SamplingParams(max_tokens=4, temperature=0, n=2, ignore_eos=True))
    with pytest.raises(ValueError, match="kept for a sample of request 'a'"):
        engine.add_request("a#1", case.prompt(1), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    for free in ("a#2", "a#01", "b#1", "a#"):
        engine.add_request(free, case.prompt(1), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    outs = engine.run_until_done()
    assert {o.request_id for o in outs if o.finished} == {"a", "a#2", "a#01", "b#1", "a#"}
    engine.blocks.check_invariants()

    from runtime.engine.sample_group import SampleGroup
    from runtime.engine.sequence import RequestStatus
    group = SampleGroup("r", n=1, best_of=3)
    for status, cumulative, tokens in ((RequestStatus.FINISHED_LENGTH, -9.0, 6),
                                       (RequestStatus.FINISHED_ABORTED, -0.1, 1),
                                       (RequestStatus.FINISHED_LENGTH, -6.0, 6)):
        group.samples.append(SimpleNamespace(status=status, cumulative_logprob=cumulative, logprobs=[0] * tokens,
                                             is_finished=True))
    assert group.reported() == [group.samples[2]]


def test_an_aborted_best_of_request_reports_its_n_best_samples_so_far(tiny):
    """The last output of a best_of > n request cut off by an abort (the server asks for it with
    `output_for(id, "abort")`) shows n samples, not every one forked so far: the complete ones first."""
    case = golden_case("ouro-tiny")
    engine = LLMEngine(tiny, hal.get("cpu"), EngineConfig(num_kv_blocks=256, block_size=4))
    engine.add_request("r", case.prompt(0), SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=2, best_of=4,
                                                           ignore_eos=True))
    while len(engine.groups["r"].samples) < 4 or not engine.groups["r"].samples[-1].output_token_ids:
        engine.step()
    assert len(engine.output_for("r").outputs) == 4                # running: every sample so far
    out = engine.output_for("r", "abort")
    assert out.finished and len(out.outputs) == 2 and all(s.finish_reason == "abort" for s in out.outputs)
    engine.abort("r")
    assert not engine.has_unfinished_requests() and engine.blocks.num_free_blocks == engine.blocks.num_blocks

    from runtime.engine.sample_group import SampleGroup
    from runtime.engine.sequence import RequestStatus
    group = SampleGroup("g", n=1, best_of=3)
    group.samples = [SimpleNamespace(status=RequestStatus.FINISHED_LENGTH, cumulative_logprob=-9.0, logprobs=[0] * 6,
                                     is_finished=True),
                     SimpleNamespace(status=RequestStatus.RUNNING, cumulative_logprob=-0.1, logprobs=[0],
                                     is_finished=False)]
    assert group.reported() == group.samples and group.reported(ending=True) == [group.samples[0]]
