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


def test_advanced_metadata_equals_the_advanced_batch():
    """`advance_meta` (speculation's chained draft passes) gives the metadata `build_meta` makes for
    the batch `steps` positions on: lengths and slots in every plane, -1 where a plane is unused."""
    from hal.attention import MetaCapacity, PagedBatch
    from hal.common.torch_attention import TorchPagedAttention

    bs = 4
    tables = [[[3, 7, 9], [2], [11, 12]], [[5, 6, 8], [1], [4, 10]], [[], [], []]]     # [plane][seq][block]
    positions = [5, 0, 2]                  # a block boundary inside the advance for seq 0 and 2
    for backend in (TritonPagedAttention(2, 2, 8, torch.float32, torch.device("cpu"), bs),
                    TorchPagedAttention(2, 2, 8, torch.float32, torch.device("cpu"), bs)):
        def batch(steps):
            return PagedBatch([1, 1, 1], [p + 1 + steps for p in positions], tables, bs)
        capacity = MetaCapacity(3, 3, 4, 3, 64)
        meta = backend.build_meta(batch(0), capacity if backend.name == "triton" else None)
        for steps in range(1, 4):
            if positions[1] + steps >= bs:          # seq 1 owns one block
                continue
            got, want = backend.advance_meta(meta, steps), backend.build_meta(batch(steps), None)
            assert list(map(int, got.seq_lens)) == list(map(int, want.seq_lens))
            assert torch.equal(got.slot_mapping, want.slot_mapping)


def test_speculation_rounds_in_one_graph_through_triton_attention():
    """Sync greedy speculation with the Triton backend: each round one captured chain whose draft
    passes advance their metadata on the device; the golden greedy tokens."""
    from runtime.config import SpeculativeConfig

    case = golden_case("ouro-tiny-gqa-bf16")
    model = zoo.from_pretrained(case.path, dtype="float32")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with interpreter(), torch.inference_mode():
        engine = LLMEngine(model, TritonOnCpu(), EngineConfig(block_size=4, max_num_batched_tokens=16, graphs=True,
                                                              max_num_seqs=4, speculative=SpeculativeConfig(2, 2)))
        for i in range(2):
            engine.add_request(str(i), case.prompt(i), params)
        outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert engine.speculator.advances and {k[0] for k in engine.runner.graphs.chains} == {"round"}
    for i in range(2):
        assert outs[str(i)] == case.greedy(i)[:6]
