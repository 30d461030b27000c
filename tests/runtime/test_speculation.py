"""Self-speculative decoding: greedy outputs equal the non-speculative engine's token for token (golden
cases, random batches with chunked prefill, preemption, stop tokens and max_tokens), sync and async;
rejected tokens' KV is never read; sampling keeps the target distribution (statistical tests)."""
import random

import pytest
import torch

import hal
import zoo
from helpers import golden_case, golden_names
from runtime import SamplingParams
from runtime.speculation.acceptance import accept_greedy, keyed_uniform, rejection_sample, sample_with_uniform
from runtime.config import EngineConfig, SpeculativeConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.kv_cache import BlockManager
from runtime.execution.sampler import filtered_probs
from runtime.engine.scheduler import Scheduler, SchedulerConfig
from runtime.engine.sequence import Request
from test_engine import random_ouro, run_engine

CPU = hal.get("cpu")


def engine_for(model, num_tokens=0, draft_loops=1, mode="sync", fuse_round=True, **config):
    spec = SpeculativeConfig(num_tokens, draft_loops, mode, fuse_round)
    config.setdefault("max_num_seqs", 8)                    # a small KV pool: cheap to allocate
    return LLMEngine(model, CPU, EngineConfig(speculative=spec, **config))


def damp_loops(model, scale):
    """Ouro: shrink every residual branch so that later loops change the state little and the
    draft agrees with the target often (scale 1: the model as built)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm_2.weight.mul_(scale)
            layer.post_attention_layernorm_2.weight.mul_(scale)
    return model


def chi2_sf(stat, dof):
    """P(chi2(dof) >= stat)."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# ----- greedy: exactly the non-speculative tokens ----------------------------------------------
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", golden_names())
def test_golden_greedy_with_speculation(name, mode):
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32")
    params = SamplingParams(max_tokens=case.meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True,
                            num_loops=case.meta.get("greedy_num_steps"), init_scale=0.0)
    depth = params.num_loops or model.default_num_loops
    engine = engine_for(model, num_tokens=3, draft_loops=depth // 2, mode=mode, block_size=4,
                        max_num_batched_tokens=7)                                # chunked prefill
    outs = run_engine(engine, [case.prompt(i) for i in range(case.num_prompts)], [params] * case.num_prompts,
                      arrive_every=1)
    assert [o.token_ids for o in outs] == [case.greedy(i) for i in range(case.num_prompts)]
    assert all(o.loops_per_token == [depth] * len(o.token_ids) for o in outs)
    rounds = sum(o.metrics.num_spec_rounds for o in outs)
    verified = sum(o.metrics.num_draft_tokens for o in outs) + rounds               # sum of k + 1
    assert rounds > 0 and 0 <= outs[0].metrics.acceptance_rate <= 1
    counters = engine.speculator.counters
    # every verified position runs depth loops in all: draft_loops in the draft, the rest in the verify
    # (a round in one graph runs K positions for a request scheduled fewer: work beyond those verified)
    computed = counters.num_verify_token_loops // (depth - depth // 2)
    assert counters.num_verify_token_loops == computed * (depth - depth // 2) and computed >= verified
    if mode == "sync":
        assert counters.num_draft_token_loops == computed * (depth // 2)
    else:
        assert computed == verified
    # draft passes and uniform verify passes replayed the padded static-buffer (graph) path; sync
    # greedy rounds (not Huginn's) replayed one chain each
    graphs = engine.runner.graphs
    if mode == "sync" and not model.has_initial_state:
        assert {key[0] for key in graphs.chains} == {"round"}
    else:
        assert {key[0] for key in graphs.captured} >= {"draft", "verify"}
    engine.blocks.check_invariants()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def record_rounds(engine):
    """Every round's verdict, in order: (request id, drafts, kept, the target's token) per request."""
    rounds, finish = [], engine.speculator._finish

    def recording(draft, verdict, ahead, blocks):
        rounds.append([(r.request_id, verdict.drafts[b], verdict.num_accepted[b], verdict.final_tokens[b])
                       for b, r in enumerate(draft.requests)])
        return finish(draft, verdict, ahead, blocks)
    engine.speculator._finish = recording
    return rounds


@pytest.mark.parametrize("seed", range(4))
def test_one_graph_round_equals_the_per_pass_round(seed):
    """A sync greedy round in one captured chain (`fuse_round`, drafts advanced on the device or
    each pass filled by the host) drafts, keeps and commits exactly what the per-pass round does,
    round by round, with padding rows (3 requests in a bucket of 4), block boundaries inside rounds
    and rounds of fewer drafts (near max_tokens: the chain runs K and keeps k)."""
    rng = random.Random(2000 + seed)
    model = damp_loops(random_ouro(rng, seed), rng.choice([0.02, 0.1]))
    depth = model.default_num_loops
    draft_loops = rng.randint(1, depth - 1) if depth > 1 else 1
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    params = SamplingParams(max_tokens=rng.randint(8, 16), temperature=0.0, ignore_eos=True)
    config = dict(block_size=rng.choice([4, 16]), max_num_batched_tokens=64)
    num_tokens = rng.choice([2, 3, 4])
    results = {}
    for name, fuse, advances in (("per-pass", False, None), ("device", True, None), ("host", True, False)):
        engine = engine_for(model, num_tokens, draft_loops, "sync", fuse_round=fuse, **config)
        engine.speculator.advances = advances
        rounds = record_rounds(engine)
        outs = run_engine(engine, prompts, [params] * len(prompts), 0)
        counters = engine.speculator.counters
        results[name] = (rounds, [o.token_ids for o in outs], counters.num_rounds, counters.num_committed)
        assert bool(engine.runner.graphs.chains) == fuse
        if fuse:                         # every round ran as a chain, short ones too
            assert not any(key[0] in ("draft", "verify") for key in engine.runner.graphs.captured)
            assert engine.speculator.advances is (advances is None)
            assert {len(c.ctxs) for c in engine.runner.graphs.chains.values()} == {2 if advances is None else
                                                                                    num_tokens + 2}
    assert results["device"] == results["per-pass"]
    assert results["host"] == results["per-pass"]
    assert any(n for round_ in results["device"][0] for _, _, n, _ in round_), "no draft was kept"
    assert any(len(x) < num_tokens for round_ in results["device"][0] for _, x, _, _ in round_), "no short round"


@pytest.mark.parametrize("seed", range(8))
def test_random_batches_equal_non_speculative(seed):
    """Random tiny Ouro models and batches: chunked prefill, small blocks, a tight cache (preemption),
    per-request loop counts (some no deeper than the draft), stop tokens and max_tokens anywhere.
    Greedy requests equal speculation off; seeded sampling requests are equal in sync and async."""
    rng = random.Random(1000 + seed)
    model = damp_loops(random_ouro(rng, seed), rng.choice([0.02, 0.1, 0.3, 1.0]))
    depth = model.default_num_loops
    draft_loops = rng.randint(1, depth - 1) if depth > 1 else 1
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 16))] for _ in range(rng.randint(2, 6))]
    loop_choices = [None, None, draft_loops, depth + 1]          # draft_loops: this request cannot speculate
    params = [SamplingParams(max_tokens=rng.randint(1, 14), num_loops=rng.choice(loop_choices),
                             temperature=rng.choice([0.0, 0.0, 0.8]), seed=rng.randrange(100),
                             top_k=rng.choice([0, 5]), ignore_eos=True,
                             stop_token_ids=tuple(rng.sample(range(vocab), rng.randint(0, 3))))
              for _ in prompts]
    block_size = rng.choice([2, 4, 16])
    largest = max(((p.num_loops or depth) + 1) * -(-(len(q) + p.max_tokens + 1) // block_size)
                  for q, p in zip(prompts, params))
    config = dict(block_size=block_size, num_kv_blocks=rng.choice([None, largest + 2]),
                  max_num_batched_tokens=rng.choice([3, 8, 64]), max_num_seqs=rng.choice([2, 8]))
    arrive_every, num_tokens = rng.choice([0, 1, 2]), rng.choice([1, 2, 4])
    results = {}
    for mode in ("off", "sync", "async"):
        spec = (0, "sync") if mode == "off" else (num_tokens, mode)
        engine = engine_for(model, spec[0], draft_loops, spec[1], **config)
        results[mode] = run_engine(engine, prompts, params, arrive_every)
        engine.blocks.check_invariants()
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    for i, p in enumerate(params):
        off, sync, asy = results["off"][i], results["sync"][i], results["async"][i]
        assert (sync.token_ids, sync.finish_reason) == (asy.token_ids, asy.finish_reason), f"request {i}"
        if p.is_greedy:
            assert (sync.token_ids, sync.finish_reason, sync.loops_per_token) == \
                   (off.token_ids, off.finish_reason, off.loops_per_token), f"request {i}"
    spec = [o.metrics for o in results["sync"] if o.metrics.num_spec_rounds]
    print(f"seed {seed}: depth {depth}, draft {draft_loops}, K {num_tokens}, "
          f"{sum(o.metrics.num_preemptions for o in results['sync'])} preemptions, acceptance "
          f"{[round(m.acceptance_rate, 2) for m in spec]}")


def test_stop_token_and_max_tokens_inside_a_draft():
    rng = random.Random(7)
    model = damp_loops(random_ouro(rng, 7), 0.02)             # the draft is nearly always right
    prompt = [rng.randrange(1, model.config.vocab_size) for _ in range(6)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    full = run_engine(engine_for(model, block_size=4), [prompt], [SamplingParams(max_tokens=24, **greedy)], 0)[0]
    firsts = [m for m, t in enumerate(full.token_ids) if t not in full.token_ids[:m]]
    params = [SamplingParams(max_tokens=n, **greedy) for n in range(1, 13)]
    params += [SamplingParams(max_tokens=24, stop_token_ids=(full.token_ids[m],), **greedy) for m in firsts]
    engine = engine_for(model, num_tokens=4, block_size=4)
    outs = run_engine(engine, [prompt] * len(params), params, 0)
    for p, out in zip(params, outs):
        if p.stop_token_ids:
            m = full.token_ids.index(p.stop_token_ids[0])
            assert (out.token_ids, out.finish_reason) == (full.token_ids[:m + 1], "stop")
        else:
            assert (out.token_ids, out.finish_reason) == (full.token_ids[:p.max_tokens], "length")
    assert outs[-1].metrics.acceptance_rate > 0.5, "the test needs drafts that are accepted"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rejected_kv_is_never_read_and_tables_shrink(mode):
    """The rollback rule: KV at positions >= a request's computed tokens is stale (async: past the
    draft it made ahead for its next round, if that was kept). Overwrite it with garbage in every
    plane after every step: the outputs must not change. In sync mode a request's tables hold
    exactly the blocks of its computed tokens after every step, as without speculation."""
    rng = random.Random(3)
    model = damp_loops(random_ouro(rng, 3), 0.1)
    prompts = [[rng.randrange(1, model.config.vocab_size) for _ in range(rng.randint(3, 9))] for _ in range(3)]
    params = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)] * 3
    expected = [o.token_ids for o in run_engine(engine_for(model, block_size=2), prompts, params, 0)]
    engine = engine_for(model, num_tokens=4, mode=mode, block_size=2)
    step, bs, rejected = engine.step, engine.blocks.block_size, []

    def stale_from(request):
        ahead = request.speculation and request.speculation.ahead
        return ahead.position + ahead.draft.num_drafts[ahead.row] + 1 if ahead else request.num_computed_tokens

    def poisoned_step():
        outs = step()
        for request in engine.scheduler.running:
            tables = engine.blocks.block_tables(request.request_id)
            if mode == "sync":
                assert len(tables[0]) == -(-request.num_computed_tokens // bs)
            rejected.append(request.metrics.num_draft_tokens - request.metrics.num_accepted_tokens)
            for table in tables:
                slots = [table[pos // bs] * bs + pos % bs for pos in range(stale_from(request), len(table) * bs)]
                for cache in engine.runner.kv_caches:
                    garbage = 1e4 * torch.randn(2, len(slots), *cache.shape[-2:])
                    cache.view(2, -1, *cache.shape[-2:])[:, slots] = garbage
        return outs

    engine.step = poisoned_step
    assert [o.token_ids for o in run_engine(engine, prompts, params, 0)] == expected
    assert max(rejected) > 0, "no draft was rejected: the rule was not exercised"


# ----- scheduling ---------------------------------------------------------------------------------
def test_scheduler_budgets_k_plus_one_and_drafts_less_rather_than_preempt():
    def decoding(rid, k):
        r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=20), num_loops=2, exit_threshold=1.0, num_planes=2,
                    num_speculative_tokens=k)
        return r

    bm = BlockManager(num_blocks=12, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=9), bm)
    a, b = decoding("a", 4), decoding("b", 4)
    for r in (a, b):
        s.add(r)
    s.schedule()                                             # both prefill 3 tokens
    for r in (a, b):
        r.num_computed_tokens = 3
        r.append_token(9, 2)
    out = s.schedule()
    assert [(i.request.request_id, i.num_tokens, i.num_draft_tokens) for i in out.scheduled] == \
           [("a", 1, 4), ("b", 1, 3)]                        # 5 + 4 tokens of the budget of 9
    assert [len(t) for t in bm.block_tables("a")] == [2, 2]  # positions 0..7: t0 at 3, drafts 4..7
    assert bm.num_free_blocks == 4 and not out.preempted
    assert bm.trim("a", 5) == 0 and bm.trim("a", 4) == 2 and [len(t) for t in bm.block_tables("a")] == [1, 1]
    bm.check_invariants()
    # max_tokens and the context bound the drafts: a round commits at most k + 1 tokens
    c = decoding("c", 4)
    c.params = SamplingParams(max_tokens=3)
    c.num_computed_tokens = 3
    c.append_token(9, 2)
    assert c.max_draft_tokens == 1
    c.max_seq_len = 5
    assert c.max_draft_tokens == 0


def test_one_requests_drafts_never_get_a_later_request_preempted():
    """Drafts take blocks only after every running request's plain token has its own: here a's
    four drafts would take the two free blocks that b's next token needs (b was preempted for them)."""
    def decoding(rid, prompt):
        return Request(rid, prompt, SamplingParams(max_tokens=8), num_loops=2, exit_threshold=1.0,
                       num_planes=2, num_speculative_tokens=4)

    bm = BlockManager(num_blocks=6, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), bm)
    a, b = decoding("a", [1, 2, 3]), decoding("b", [1, 2, 3, 4])
    for r in (a, b):
        s.add(r)
    s.schedule()                                             # one block per plane each: 2 of 6 left
    for r in (a, b):
        r.num_computed_tokens = len(r.prompt_token_ids)
        r.append_token(9, 2)
    out = s.schedule()                       # a's token at 3 (in its block), b's at 4 (new blocks)
    assert not out.preempted
    assert [(i.request.request_id, i.num_tokens, i.num_draft_tokens) for i in out.scheduled] == \
           [("a", 1, 0), ("b", 1, 3)]                       # b's drafts 5..7 share its new block
    assert bm.num_free_blocks == 0
    bm.check_invariants()


def test_seeded_sampling_gives_the_tokens_of_no_speculation_under_any_load():
    """A seeded request's round draws the target's tokens with the plain sampler's keyed noise and
    keeps the drafts equal to them, so speculation changes none of its tokens, alone or beside other
    requests (whose budget changes how its rounds are cut). Rejection sampling gave other tokens
    under load: the position of each draw depended on the cut."""
    rng = random.Random(1)
    model = damp_loops(random_ouro(rng, 1), 0.3)
    vocab = model.config.vocab_size
    target = [3, 4, 5, 6]
    seeded = [SamplingParams(max_tokens=30, temperature=1.0, seed=1234, ignore_eos=True),
              SamplingParams(max_tokens=30, temperature=0.7, top_p=0.9, top_k=20, seed=7, ignore_eos=True)]
    others = [[rng.randrange(1, vocab) for _ in range(5)] for _ in range(3)]
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for params in seeded:
        runs = {}
        for k in (0, 4):
            for load in (False, True):
                engine = LLMEngine(model, hal.get("cpu"), EngineConfig(
                    speculative=SpeculativeConfig(k, 1), max_num_batched_tokens=8, max_num_seqs=4))
                prompts = (others if load else []) + [target]
                outs = run_engine(engine, prompts, ([greedy] * 3 if load else []) + [params], 0)
                runs[k, load] = outs[-1].token_ids
        assert runs[0, False] == runs[0, True] == runs[4, False] == runs[4, True], runs


def test_bad_configurations_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="kv_mode=full or last_exited"):
        EngineConfig(kv_mode="shared", speculative=dict(num_tokens=2))
    with pytest.raises(ValueError, match="speculative.mode"):
        SpeculativeConfig(2, 1, "eager")
    with pytest.raises(ValueError, match="draft_loops"):
        SpeculativeConfig(2, 0)
    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")
    engine = engine_for(model, num_tokens=2)
    with pytest.raises(ValueError, match=r"exit_threshold=1.0 on the command line\), or turn speculation off \(engine.speculative.num_tokens=0\)"):
        engine.add_request("x", [1, 2], SamplingParams(exit_threshold=0.5))
    engine.add_request("y", [1, 2], SamplingParams(num_loops=1, exit_threshold=0.5))   # no deeper than the draft


def test_cli_options_reach_the_engine_config():
    from hydra import compose, initialize_config_dir

    from runtime.cli import CONF_DIR, engine_config, register_schemas

    register_schemas()               # the configs name the schema nodes the CLIs store
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("generate", overrides=["engine.speculative.num_tokens=3", "engine.speculative.mode=async"])
        bench = compose("bench", overrides=["engine.speculative.draft_loops=2", "engine.speculative.num_tokens=5"])
    assert engine_config(cfg).speculative == SpeculativeConfig(3, 1, "async")
    assert engine_config(bench).speculative == SpeculativeConfig(5, 2, "sync")


# ----- sampling: the target distribution ------------------------------------------------------------
def test_rejection_sampling_gives_the_target_distribution():
    """Chi-square over a vocabulary of 6: the first committed token follows the target p, whatever
    the draft q; the drafts themselves (q) are rejected by the same test (the test has power)."""
    gen = torch.Generator().manual_seed(0)
    num, vocab, k = 40000, 6, 2
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, -1)
    drafts = torch.stack([sample_with_uniform(q[j].expand(num, vocab), torch.rand(num, generator=gen))
                          for j in range(k)], 1)                                   # [N, K]
    verdict = rejection_sample(p.expand(num, k + 1, vocab), q.expand(num, k, vocab), drafts,
                               torch.full((num,), k), torch.rand(num, k, generator=gen),
                               torch.rand(num, k + 1, generator=gen))
    first = torch.where(verdict.num_accepted > 0, drafts[:, 0], verdict.final_token)
    counts = torch.bincount(first, minlength=vocab).double()

    def pvalue(probs):
        expected = num * probs.double()
        return chi2_sf(float(((counts - expected) ** 2 / expected).sum()), vocab - 1)

    assert pvalue(p[0]) > 1e-3
    assert pvalue(q[0]) < 1e-6
    assert 0.1 < verdict.num_accepted.float().mean() / k < 0.9           # both paths taken
    # keyed uniforms: fixed by the key, spread evenly
    u = torch.tensor([keyed_uniform(5, pos, 0) for pos in range(20000)])
    assert keyed_uniform(5, 3, 1) == keyed_uniform(5, 3, 1) != keyed_uniform(5, 3, 2)
    assert chi2_sf(float(((torch.bincount((u * 10).long(), minlength=10) - 2000.0) ** 2 / 2000).sum()), 9) > 1e-3
    assert accept_greedy([4, 5, 6], [4, 5, 7, 8]) == 2 and accept_greedy([1], [2, 3]) == 0


@pytest.mark.parametrize("mode,seeded", [("sync", False), ("async", False), ("sync", True)])
def test_engine_sampling_follows_the_target_distribution(mode, seeded):
    """End to end on a 4-token vocabulary: the first three generated tokens of many requests
    against their exact joint distribution under the target (full depth, top-p filtered), by
    chi-square over the 64 cells. Tokens 2 and 3 come from speculation rounds: unseeded, by
    rejection sampling (kept drafts, residual draws and bonus tokens; the drafts' own distribution
    differs enough that always accepting, or skipping the residual, fails this test); seeded, by
    the target's keyed draws that the drafts must equal."""
    torch.manual_seed(0)                   # unseeded requests draw from the global RNG
    config = {"model_type": "ouro", "vocab_size": 4, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
              "total_ut_steps": 3, "max_position_embeddings": 64, "rope_theta": 10000.0, "eos_token_id": 0}
    model = zoo.from_config(config, dtype="float32", seed=3)
    with torch.no_grad():                  # sharper weights: the draft (1 loop of 3) differs from the target
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    prompt, num = [1, 3, 2, 1, 0, 3], 1000
    params = [SamplingParams(max_tokens=4, temperature=1.0, top_p=0.95, seed=i if seeded else None,
                             ignore_eos=True) for i in range(num)]
    engine = engine_for(model, num_tokens=3, draft_loops=1, mode=mode, max_num_seqs=256)
    outs = run_engine(engine, [prompt] * num, params, 0)
    observed = torch.zeros(4, 4, 4, dtype=torch.float64)
    for out in outs:
        observed[tuple(out.token_ids[:3])] += 1
    prefixes = torch.tensor([prompt + [a, b] for a in range(4) for b in range(4)])         # [16, P + 2]
    with torch.no_grad():
        logits = model(prefixes).logits[:, len(prompt) - 1:].double()                      # [16, 3, V]
    probs = torch.stack([filtered_probs(row, params[0]).double() for row in logits.flatten(0, 1)]).view(4, 4, 3, 4)
    joint = probs[0, 0, 0][:, None, None] * probs[:, 0, 1][:, :, None] * probs[:, :, 2]     # p(a) p(b|a) p(c|ab)
    expected = num * joint
    big = expected >= 5                                       # cells too rare to test alone are pooled
    stat = ((observed[big] - expected[big]) ** 2 / expected[big]).sum()
    rest_obs, rest_exp = observed[~big].sum(), expected[~big].sum()
    stat += (rest_obs - rest_exp) ** 2 / rest_exp if rest_exp > 0 else 0
    dof = int(big.sum()) + int(rest_exp > 0) - 1
    assert chi2_sf(float(stat), dof) > 1e-3, f"chi-square {float(stat):.1f} on {dof} degrees of freedom"
    rate = sum(o.metrics.num_accepted_tokens for o in outs) / sum(o.metrics.num_draft_tokens for o in outs)
    print(f"{mode}: acceptance {rate:.2f}, chi-square {float(stat):.1f} on {dof} degrees of freedom")
    assert 0.2 < rate < 0.95, f"acceptance {rate:.2f}: both acceptance and rejection must be exercised"


# ----- costs --------------------------------------------------------------------------------------
def test_step_costs_leave_requests_unchanged_and_break_even_is_consistent():
    from runtime.speculation.costs import break_even_acceptance, measure_step_costs, tokens_per_round

    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32")
    engine = engine_for(model, num_tokens=3, block_size=4)
    params = SamplingParams(max_tokens=case.meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True)
    for i in range(case.num_prompts):
        engine.add_request(str(i), case.prompt(i), params)
    engine.step()                                              # every prompt prefilled
    costs = measure_step_costs(engine, repeats=1)
    assert all(costs[k] > 0 for k in ("draft_pass_ms", "verify_ms", "decode_ms", "round_ms"))
    outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert [outs[str(i)] for i in range(case.num_prompts)] == [case.greedy(i) for i in range(case.num_prompts)]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    a = break_even_acceptance(2.5, 4)
    assert abs(tokens_per_round(a, 4) - 2.5) < 1e-9 and break_even_acceptance(0.8, 4) == 0.0
    assert break_even_acceptance(5.5, 4) is None and tokens_per_round(1.0, 4) == 5.0


def test_bench_reports_speculation():
    from hydra import compose, initialize_config_dir

    from runtime.bench import run
    from runtime.generate import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("bench", overrides=["hal=cpu", f"model.path={golden_case('ouro-tiny').path}",
                                          "weights=checkpoint", "model.dtype=float32", "workload=tiny", "matmul_size=64",
                                          "engine.num_kv_blocks=200", "warmup=false",
                                          "engine.speculative.num_tokens=2"])
    (row,) = run(cfg)
    assert row["spec"] == "K=2,d=1,sync" and 0 <= row["acceptance_rate"] <= 1 and row["decode_tok_s"] > 0
    assert row["round_ms"] > 0 and "break_even_acceptance" in row
