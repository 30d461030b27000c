"""Is async speculation repeatable beside FP8 weights? (split-K slice kernels on two streams.) On an
NVIDIA GPU: Ouro-1.4B shape, random bf16 weights, 64 greedy tokens for 1 and 3 prompts, two engines
per mode (sync, async), FP8 weights and bf16; prints whether async repeats itself and the sync
tokens. Run from the repository root: `python3 tools/spec_repeat_probe.py`.

With one request the async tokens must be the sync tokens. With several, the draft ahead covers a
subset of the rows, so the draft's GEMMs see other row counts and near-ties may flip (repeatably).
"""
import random

import torch

import hal
import zoo
from runtime import SamplingParams
from runtime.config import EngineConfig, SpeculativeConfig
from runtime.engine.llm_engine import LLMEngine

gpu = hal.get("cuda")
rng = random.Random(0)
prompts = [[rng.randrange(1, 49152) for _ in range(rng.randint(4, 120))] for _ in range(8)]
for weights in ("fp8", "auto"):
    model = zoo.from_config("zoo/configs/ouro-1.4b.json", dtype="bfloat16", device=gpu.device(), seed=0)
    for num_prompts in (1, 3):
        toks = {}
        for mode in ("sync", "async"):
            rounds = []
            for rep in range(2):
                engine = LLMEngine(model, gpu, EngineConfig(speculative=SpeculativeConfig(4, 2, mode), weights_dtype=weights,
                                                            max_num_seqs=8, max_model_len=512, max_num_batched_tokens=4096))
                params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
                for i, p in enumerate(prompts[:num_prompts]):
                    engine.add_request(str(i), p, params)
                outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
                rounds.append([outs[str(i)] for i in range(num_prompts)])
                del engine
                torch.cuda.empty_cache()
            toks[mode] = rounds
        stable = {m: all(r == toks[m][0] for r in toks[m]) for m in toks}
        same = sum(a == b for a, b in zip(toks["sync"][0], toks["async"][0]))
        print(f"PROBE weights={weights} prompts={num_prompts}: async==sync {same}/{num_prompts}; "
              f"repeatable sync={stable['sync']} async={stable['async']}", flush=True)
