"""The engine on the Triton backend (run by the Triton interpreter on the CPU): golden greedy tokens
through packed prefill, chunked prefill and padded decode graphs with in-place metadata updates."""
import torch

import zoo
from hal.cpu import CpuHal
from hal.kernels.backend import TritonPagedAttention
from interp import interpreter
from helpers import golden_case
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine


class TritonOnCpu(CpuHal):
    def attention(self, num_heads, num_kv_heads, head_dim, dtype, block_size=None, backend=None):
        return TritonPagedAttention(num_heads, num_kv_heads, head_dim, dtype, self.device(), block_size or 16)


def test_golden_greedy_through_triton_attention():
    case = golden_case("ouro-tiny-gqa-bf16")
    model = zoo.from_pretrained(case.path, dtype="float32")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with interpreter(), torch.inference_mode():
        engine = LLMEngine(model, TritonOnCpu(), EngineConfig(block_size=4, max_num_batched_tokens=9, graphs=True))
        assert engine.runner.backend.name == "triton"
        for i in range(case.num_prompts):
            engine.add_request(str(i), case.prompt(i), params)
        outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert engine.runner.graphs.captured, "the padded decode path was not used"
    for i in range(case.num_prompts):
        assert outs[str(i)] == case.greedy(i)[:6]
