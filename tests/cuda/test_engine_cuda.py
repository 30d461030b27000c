"""On an NVIDIA GPU: golden cases in float32 (TF32 off), and graphs on == graphs off at the real
Ouro-1.4B shape in bf16 (run by tools/gpu_check.sh on the H200)."""
import random

import pytest
import torch

import hal
import zoo
from helpers import CONFIGS, golden_case, golden_names
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.cuda


def _golden_params(case):
    kwargs = dict(max_tokens=case.meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True,
                  num_loops=case.meta.get("greedy_num_steps"))
    if "init_scale" in SamplingParams.__dataclass_fields__:
        kwargs["init_scale"] = 0.0
    return SamplingParams(**kwargs)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("name", golden_names())
def test_golden_greedy_and_logits_fp32(name, graphs):
    gpu = hal.get("cuda")
    case = golden_case(name)
    try:
        model = zoo.from_pretrained(case.path, dtype="float32", device=gpu.device())
    except Exception as exc:  # a family not in the zoo yet
        pytest.skip(str(exc))
    engine = LLMEngine(model, gpu, EngineConfig(graphs=graphs, max_num_batched_tokens=16))
    params = _golden_params(case)
    for i in range(case.num_prompts):
        engine.add_request(str(i), case.prompt(i), params)
    outs = {o.request_id: o for o in engine.run_until_done()}
    for i in range(case.num_prompts):
        assert outs[str(i)].token_ids == case.greedy(i), f"prompt {i}"
    logits_key = "logits_0" if "logits_0" in case.tensors else f"logits_0_steps{case.meta.get('greedy_num_steps')}"
    ids = torch.tensor([case.prompt(0)], device=gpu.device())
    with torch.no_grad():
        kwargs = {"num_loops": case.meta["greedy_num_steps"]} if "greedy_num_steps" in case.meta else {}
        if "init_scale" in model.forward.__code__.co_varnames:
            kwargs["init_scale"] = 0.0
        logits = model(ids, **kwargs).logits[0].float().cpu()
    err = (logits - case.tensors[logits_key]).abs().max().item()
    print(f"{name}: max |logits - golden| on cuda fp32 = {err:.2e}")
    assert err <= 1e-3


def test_seeded_huginn_random_state_equals_the_simple_path():
    """Huginn's random initial state of a seeded request is keyed by (seed, position) on the device,
    drawn before a decode graph's replay or inside the eager pass: the simple path's tokens, in a
    batch whose chunks cut the prompt, with graphs."""
    from runtime.execution.reference import generate_reference

    gpu = hal.get("cuda")
    case = golden_case("huginn-tiny")
    model = zoo.from_pretrained(case.path, dtype="float32", device=gpu.device())
    params = SamplingParams(max_tokens=10, temperature=0.0, seed=7, ignore_eos=True, num_loops=4, init_scale=4.0)
    prompts = [case.prompt(1) * 2, case.prompt(0)]
    expected = [generate_reference(model, p, params)[0] for p in prompts]
    engine = LLMEngine(model, gpu, EngineConfig(block_size=16, max_num_batched_tokens=16))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert [outs["0"], outs["1"]] == expected


def test_graphs_equal_eager_at_ouro_1_4b_shape_bf16():
    gpu = hal.get("cuda")
    model = zoo.from_config(CONFIGS / "ouro-1.4b.json", dtype="bfloat16", device=gpu.device(), seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 49152) for _ in range(rng.randint(4, 200))] for _ in range(64)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    for graphs in (False, True):
        engine = LLMEngine(model, gpu, EngineConfig(graphs=graphs, max_num_seqs=64, max_model_len=256,
                                                    max_num_batched_tokens=4096))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        results[graphs] = {o.request_id: o.token_ids for o in engine.run_until_done()}
        if graphs:
            assert engine.runner.graphs.captured, "no graph was captured"
        del engine
        torch.cuda.empty_cache()
    same = sum(results[True][k] == results[False][k] for k in results[False])
    print(f"graphs vs eager, Ouro-1.4B shape bf16, 64 requests: {same}/64 identical")
    assert same == 64


def test_nanbeige_one_row_products_on_the_tma_ring_graphs_equal_eager(monkeypatch):
    """Batch 1 at the real Nanbeige4.2-3B shape runs its four projections on hal/cuda/ring_gemv.py's ring
    (its table's shapes), captured and eager alike: the same tokens. Against the library (cuBLASLt's
    table, LOOPSTACK_RING_GEMV=0: another sum order) the agreement is printed, not asserted."""
    ring = pytest.importorskip("hal.cuda.ring_gemv")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA ring is built for sm_90")
    calls = []
    real = ring.ring_linear

    def counted(*args, **kwargs):
        calls.append(tuple(args[1].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(ring, "ring_linear", counted)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 166144) for _ in range(rng.randint(8, 100))] for _ in range(3)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = {}
    for name, graphs, env in (("eager", False, None), ("graphs", True, None), ("library", True, "0")):
        if env is None:
            monkeypatch.delenv(ring.ENV, raising=False)
        else:
            monkeypatch.setenv(ring.ENV, env)
        gpu = hal.get("cuda")            # a fresh Hal: the product is chosen once per Hal, from the env
        model = zoo.from_config(CONFIGS / "nanbeige4.2-3b.json", dtype="bfloat16", device=gpu.device(), seed=0)
        engine = LLMEngine(model, gpu, EngineConfig(graphs=graphs, max_num_seqs=1, max_model_len=256))
        calls.clear()
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        results[name] = {o.request_id: o.token_ids for o in engine.run_until_done()}
        if name == "eager":
            assert set(calls) == set(ring.NANBEIGE_4_2_3B), calls[:8]
        if name == "library":
            assert calls == []
        del engine, model
        torch.cuda.empty_cache()
    assert results["graphs"] == results["eager"]
    same = sum(results["library"][k] == results["eager"][k] for k in results["eager"])
    print(f"Nanbeige4.2-3B b1, ring against the library: {same}/{len(prompts)} sequences identical")


@pytest.mark.parametrize("prompt_len,width,fresh", [(8150, 8192, True), (4096, 4096, True),
                                                    (2040, 2048, True), (1500, 1536, True)])
def test_a_long_prompt_replays_a_captured_prefill(prompt_len, width, fresh, monkeypatch):
    """A prompt past the short buckets replays a captured prefill of its bucket (padded), captured
    over the prompt itself; its attention is the eager pass's fresh path inside the graph (cuDNN at
    Ouro's head shape from `fresh.MIN_TOKENS`), so its greedy tokens equal the eager pass's."""
    from hal.kernels import fresh as fresh_module
    from runtime.execution.runner import ModelRunner

    gpu = hal.get("cuda")
    model = zoo.from_config(CONFIGS / "ouro-1.4b.json", dtype="bfloat16", device=gpu.device(), seed=0)
    rng = random.Random(prompt_len)
    prompt = [rng.randrange(1, 49152) for _ in range(prompt_len)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = {}
    for captured in (True, False):
        if not captured:
            monkeypatch.setattr(ModelRunner, "chunk_bucket", lambda self, item: None)
        engine = LLMEngine(model, gpu, EngineConfig(max_num_seqs=1, max_model_len=8300,
                                                    max_num_batched_tokens=8192))
        engine.add_request("0", prompt, params)
        results[captured] = [o.token_ids for o in engine.run_until_done()]
        if captured:
            # the short buckets were captured at start (engine.capture_at_start)
            keys = [k for k in engine.runner.graphs.captured if k[0] == "prefill" and k[1] > 1024]
            assert [(k[1], k[4], k[5]) for k in keys] == [(width, fresh, False)], keys
            assert engine.runner.graphs.captured[keys[0]].ctx.meta.fresh_lens == ((width,) if fresh else None)
        del engine
        torch.cuda.empty_cache()
    assert not fresh_module._cudnn_refused, fresh_module._cudnn_refused[:1]
    print(f"captured vs eager prefill of {prompt_len} tokens: {results[True]} / {results[False]}")
    assert results[True] == results[False]


def test_steps_replay_the_passes_captured_at_start():
    """At the real Ouro-1.4B shape (bf16, async scheduling: two copies of each decode graph) the engine
    captures every decode bucket and short prefill when it starts; requests of mixed lengths that
    finish apart then capture nothing more, and give the tokens of an engine that captures on first use."""
    gpu = hal.get("cuda")
    model = zoo.from_config(CONFIGS / "ouro-1.4b.json", dtype="bfloat16", device=gpu.device(), seed=0)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 49152) for _ in range(rng.randint(5, 300))] for _ in range(6)]
    results = {}
    for at_start in (True, False):
        engine = LLMEngine(model, gpu, EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=1024,
                                                    capture_at_start=at_start))
        captured = dict(engine.runner.graphs.captured)
        if at_start:
            assert {k[1] for k in captured if k[0] == "decode"} == {1, 2, 4, 8}
            assert {k[3] for k in captured if k[0] == "decode"} == {0, 1}
            assert {k[1] for k in captured if k[0] == "prefill"} == {16, 32, 64, 128, 256, 512}
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True))
        outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
        results[at_start] = [outs[str(i)] for i in range(len(prompts))]
        if at_start:
            assert engine.runner.graphs.captured == captured, set(engine.runner.graphs.captured) - set(captured)
            print(f"captured {len(captured)} passes at start in {engine.runner.start_capture_s:.2f} s")
        del engine
        torch.cuda.empty_cache()
    assert results[True] == results[False]


def test_a_burst_of_chunked_prompts_replays_captured_prefills(monkeypatch):
    """Prompts longer than the step's token budget, arriving together at the real Ouro-1.4B shape
    (bf16): the steps of their chunks (most not a prompt's last, beside decodes or none) replay a
    captured prefill per chunk (`ModelRunner.split_step`, as on a Hal whose backend captures no
    packed batches: packed steps are turned off here); with graphs off the same chunks run
    eagerly, each padded to its bucket, so the greedy tokens are the eager engine's (a packed pass
    would round differently and flip random weights' near-ties)."""
    from helpers import count_step_kinds
    from runtime.execution.runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "packed_step", lambda self, scheduled: None)
    kinds = count_step_kinds(monkeypatch, ("split", "prefill", "eager"))
    gpu = hal.get("cuda")
    model = zoo.from_config(CONFIGS / "ouro-1.4b.json", dtype="bfloat16", device=gpu.device(), seed=0)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 49152) for _ in range(rng.randint(300, 700))] for _ in range(6)]
    results = {}
    for graphs in (True, False):
        engine = LLMEngine(model, gpu, EngineConfig(graphs=graphs, max_num_seqs=8, max_num_batched_tokens=512,
                                                    max_model_len=1024))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=8 + i, temperature=0.0, ignore_eos=True))
        outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
        results[graphs] = [outs[str(i)] for i in range(len(prompts))]
        # (a lone chunk, such as the first step's, replays its prefill without a split)
        assert kinds["eager"] == 0 and kinds["split"] + kinds["prefill"] >= 6, kinds
        kinds.update(dict.fromkeys(kinds, 0))
        del engine
        torch.cuda.empty_cache()
    assert results[True] == results[False]


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_a_burst_beside_decodes_replays_packed_passes(kv_dtype, monkeypatch):
    """Prompts of 700-1,000 tokens joining a decoding batch at the real Ouro-1.4B shape (bf16), at a
    budget of 2,048 tokens (past the split caps): the steps of their chunks and the decodes replay
    one packed pass each (runtime/execution/packed_steps.py); with graphs off the same padded passes
    run eagerly, and the greedy tokens are the same. With an FP8 cache the decode rows of those mixed
    steps take the FP8 row path, which the CPU suite runs only in the interpreter."""
    from runtime.execution.runner import ModelRunner

    gpu = hal.get("cuda")
    model = zoo.from_config(CONFIGS / "ouro-1.4b.json", dtype="bfloat16", device=gpu.device(), seed=0)
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 49152) for _ in range(rng.randint(700, 1000))] for _ in range(8)]
    num_packed = []
    packed = ModelRunner._execute_packed
    monkeypatch.setattr(ModelRunner, "_execute_packed",
                        lambda self, *a, **k: num_packed.append(1) or packed(self, *a, **k))
    results = {}
    for graphs in (True, False):
        engine = LLMEngine(model, gpu, EngineConfig(graphs=graphs, max_num_seqs=16, max_num_batched_tokens=2048,
                                                    max_model_len=1100, kv_dtype=kv_dtype))
        for i, prompt in enumerate(prompts[:2]):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        engine.step()
        engine.step()
        for i, prompt in enumerate(prompts[2:], start=2):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=6 + i, temperature=0.0, ignore_eos=True))
        outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
        results[graphs] = [outs[str(i)] for i in range(len(prompts))]
        assert len(num_packed) >= 2, len(num_packed)
        num_packed.clear()
        del engine
        torch.cuda.empty_cache()
    assert results[True] == results[False]


def test_a_long_prompt_at_the_default_budget_replays_its_chunks(monkeypatch):
    """A 7,000-token prompt at the engine's default budget (2,048 tokens), alone and then joining two
    decoding requests, at the real Ouro-1.4B shape (bf16): alone, each chunk replays a captured
    prefill (the chunks before the last sample nothing); beside the decodes, each step of one of its
    chunks replays the decode pass and the chunk's prefill. Graphs off gives the long prompt the same
    tokens (its chunks of 2,048 run the eager pass: uncaptured, the prefills are padded only up to
    1,024 tokens; the decoding requests' tokens may differ there at near-ties: their rows attend
    through another kernel in the eager pass)."""
    from helpers import count_step_kinds

    kinds = count_step_kinds(monkeypatch, ("prefill", "split", "eager"))
    gpu = hal.get("cuda")
    model = zoo.from_config(CONFIGS / "ouro-1.4b.json", dtype="bfloat16", device=gpu.device(), seed=0)
    rng = random.Random(11)
    long = [rng.randrange(1, 49152) for _ in range(7000)]
    short = [[rng.randrange(1, 49152) for _ in range(300)] for _ in range(2)]
    results, counts = {}, {}
    for graphs in (True, False):
        engine = LLMEngine(model, gpu, EngineConfig(graphs=graphs, max_num_seqs=4, max_model_len=7200))
        engine.add_request("alone", long, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
        alone = dict(kinds)
        for i, prompt in enumerate(short):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
        engine.step()
        engine.step()
        engine.add_request("joining", long, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        outs.update({o.request_id: o.token_ids for o in engine.run_until_done()})
        results[graphs], counts[graphs] = outs, (alone, dict(kinds))
        for kind in kinds:
            kinds[kind] = 0
        del engine
        torch.cuda.empty_cache()
    assert [results[True][k] for k in ("alone", "joining")] == [results[False][k] for k in ("alone", "joining")]
    alone, both = counts[True]
    assert alone["prefill"] == 4 and alone["eager"] == 0, alone
    assert both["split"] >= 4 and both["eager"] == 0, both


def test_early_exit_steps_replay_captured_passes_at_ouro_1_4b_shape(monkeypatch):
    """Requests with early exit (thresholds away from the random gates' cumulative 0.5 / 0.75 /
    0.875) at the real Ouro-1.4B shape (bf16): the prompts prefill in one packed pass that chooses
    their exit loops on the device, and the decode steps replay the captured exit pass. Tokens and
    loops per token equal those of (a) graphs off: the same padded passes run eagerly, and (b) the
    host's loop controller (the eager pass) for every decode step after that shared prefill. (An
    eager prefill is not the oracle here: the packed pass's padded products round differently in
    bf16 and flip random weights' near-ties, as in the other packed tests.)"""
    from helpers import count_step_kinds

    kinds = count_step_kinds(monkeypatch, ("packed", "eager"))
    gpu = hal.get("cuda")
    model = zoo.from_config(CONFIGS / "ouro-1.4b.json", dtype="bfloat16", device=gpu.device(), seed=0)
    rng = random.Random(13)
    prompts = [[rng.randrange(1, 49152) for _ in range(rng.randint(20, 200))] for _ in range(4)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, exit_threshold=t)
              for t in (0.6, 0.8, 0.95, 1.0)]
    results = {}
    for mode in ("captured", "graphs off", "host rule"):
        engine = LLMEngine(model, gpu, EngineConfig(max_num_seqs=4, max_model_len=256, graphs=mode != "graphs off"))
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), prompt, p)
        engine.step()
        assert kinds["packed"] == 1, kinds
        if mode == "host rule":
            engine.runner.captures_exits = False
        outs = {o.request_id: o for o in engine.run_until_done()}
        results[mode] = [(outs[str(i)].token_ids, outs[str(i)].loops_per_token) for i in range(4)]
        if mode == "captured":
            assert kinds["eager"] == 0 and any(key[0] == "decode_exit" for key in engine.runner.graphs.captured)
        if mode == "host rule":
            assert kinds["eager"] >= 9, kinds
        kinds.update(dict.fromkeys(kinds, 0))
        del engine
        torch.cuda.empty_cache()
    assert results["captured"] == results["graphs off"]
    assert results["captured"] == results["host rule"]
    assert {n for _, loops in results["captured"] for n in loops} != {4}
