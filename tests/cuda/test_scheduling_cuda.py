"""On an NVIDIA GPU: the scheduling features (docs/scheduling.md) keep the golden greedy tokens in
float32, and async scheduling (device-side token feed, page-locked readback, two copies of each
decode graph) equals synchronous scheduling at the real Ouro-1.4B shape in bf16 with graphs on."""
import random

import pytest

import hal
import zoo
from helpers import CONFIGS, golden_case, golden_names
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("preemption", ["swap", "recompute"])
@pytest.mark.parametrize("name", golden_names())
def test_golden_greedy_with_every_feature_fp32(name, preemption):
    gpu = hal.get("cuda")
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32", device=gpu.device())
    params = SamplingParams(max_tokens=case.meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True,
                            num_loops=case.meta.get("greedy_num_steps"), init_scale=0.0)
    planes = (params.num_loops or model.default_num_loops) + model.kv_spec.num_fixed_planes
    longest = max(len(case.prompt(i)) for i in range(case.num_prompts)) + params.max_tokens + 1
    engine = LLMEngine(model, gpu, EngineConfig(
        max_num_batched_tokens=7, block_size=16, num_kv_blocks=planes * (-(-longest // 16) + 1), graphs=True,
        preemption_mode=preemption, enable_prefix_caching=True, scheduling_policy="priority",
        async_scheduling=True, wavefront_prefill=True))
    prompts = [case.prompt(i) for i in range(case.num_prompts)]
    for i, prompt in enumerate(prompts + prompts):
        engine.add_request(str(i), prompt, params, priority=i % 2)
    outs = {o.request_id: o for o in engine.run_until_done()}
    for i in range(2 * case.num_prompts):
        assert outs[str(i)].token_ids == case.greedy(i % case.num_prompts), f"prompt {i}"
    engine.blocks.check_invariants()
    assert not engine.swap.host


def test_async_equals_sync_at_the_real_shape_bf16():
    gpu = hal.get("cuda")
    model = zoo.from_config(CONFIGS / "ouro-1.4b.json", dtype="bfloat16", device=gpu.device(), seed=0)
    rng = random.Random(0)
    # as many slots as prompts: both modes then run the very same batches (bf16 rounding included)
    prompts = [[rng.randrange(1, 30000) for _ in range(rng.randint(8, 200))] for _ in range(12)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    for async_ in (False, True):
        engine = LLMEngine(model, gpu, EngineConfig(graphs=True, max_num_seqs=16, max_num_batched_tokens=256,
                                                    async_scheduling=async_, kv_cache_memory_bytes=4 << 30))
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
        results[async_] = [outs[str(i)] for i in range(len(prompts))]
        assert engine.runner.graphs.captured
    assert results[True] == results[False]
