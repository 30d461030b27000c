"""Int8 KV on the simulated Ascend Hal (hal/ascend/quant_attention.py; the 910B has no FP8): the byte
layout round-trips, decode goes through the fused op's paged antiquant (mode 5) inside graphs with
per-replay updates, passes of several queries per sequence by rows or over dequantized blocks, and the
engine gives the CPU int8 engine's tokens.
The antiquant call's schema is checked against torch-npu in CI (.ci/ascend_schema_check.sh)."""
import pytest
import torch
from helpers import golden_case, single_thread  # noqa: F401 (fixture)

import hal
import zoo
from hal.ascend.quant_attention import Int8FusedAttention
from hal.attention import PagedBatch
from hal.common.kv_quant import fake_quantize
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine


def sim(**kwargs):
    return hal.get("ascend-sim", sim_any_shape=True, **kwargs)


def test_int8_cache_layout_round_trips(single_thread):
    backend = sim().attention(8, 2, 24, torch.bfloat16, block_size=16, kv_dtype=torch.int8)
    assert isinstance(backend, Int8FusedAttention) and backend.kv_cache_dtype == torch.uint8
    cache = torch.zeros(backend.kv_cache_shape(6), dtype=torch.uint8)
    values, scales = backend.block_views(cache)
    assert values.shape == (2, 6, 16, 2, 24) and values.dtype == torch.uint8 and values[0].is_contiguous()
    assert backend.values(cache).shape == (2, 6, 16, 48) and backend.values(cache).dtype == torch.int8
    assert scales.shape == (2, 6, 2, 16) and scales.dtype == torch.float32 and scales[1].is_contiguous()
    batch = PagedBatch([20, 9], [20, 9], [[[4, 1], [0]]], 16)
    k, v = torch.randn(29, 2, 24).bfloat16() * 5, torch.randn(29, 2, 24).bfloat16()
    backend.write_kv(k, v, cache, backend.build_meta(batch), 0)
    slots = torch.tensor([*range(64, 80), *range(16, 20), *range(0, 9)])
    keys, vals = backend.read_kv(cache, slots)
    assert torch.equal(keys, fake_quantize(k.float(), torch.int8).bfloat16())
    assert torch.equal(vals, fake_quantize(v.float(), torch.int8).bfloat16())
    backend.copy_kv(cache, slots[:3], torch.tensor([90, 91, 92]))
    assert torch.equal(backend.read_kv(cache, torch.tensor([90, 91, 92]))[0], keys[:3])
    with pytest.raises(ValueError, match="use kv_dtype=int8"):
        sim().attention(8, 2, 24, torch.bfloat16, block_size=16, kv_dtype=torch.float8_e4m3fn)


def test_passes_attend_by_rows_or_over_dequantized_blocks_whichever_moves_fewer_bytes():
    """Eager steps go by their lengths: a 40-token prompt without context dequantizes its 3 blocks
    (40 x 40 row reads against 5 x 48 bytes per element), decodes beside a 4-token chunk go by rows,
    each row with its causal KV length. Captured passes go by their capacity: rows where the tables
    have room for context (a verify pass of any width), dequantized blocks for a prompt's own."""
    from hal.ascend.quant_attention import _row_kv_lens
    from hal.attention import MetaCapacity

    backend = sim().attention(8, 2, 24, torch.bfloat16, block_size=16, kv_dtype=torch.int8)
    assert backend.build_meta(PagedBatch([40], [40], [[[0, 1, 2]]], 16)).row_seqs is None
    mixed = backend.build_meta(PagedBatch([1, 4, 1], [30, 20, 50], [[[0, 1], [2, 3], [4, 5, 6, 7]]], 16))
    assert mixed.row_seqs.tolist() == [0, 1, 1, 1, 1, 2]
    assert _row_kv_lens(mixed, 0) == [30, 17, 18, 19, 20, 50]
    assert mixed.row_kv_lens == {0: [30, 17, 18, 19, 20, 50]}          # once per plane and step
    verify = PagedBatch([17, 17], [40, 60], [[[0, 1, 2], [3, 4, 5, 6]]], 16)
    for context, by_rows in ((True, True), (False, False)):
        capacity = MetaCapacity(2, 34, 20, 1, 300, context=context)
        assert (backend.build_meta(verify, capacity).row_seqs is not None) == by_rows
    meta = backend.build_meta(verify, MetaCapacity(2, 34, 20, 1, 300))
    assert _row_kv_lens(meta, 0) == [*range(24, 41), *range(44, 61)]
    backend.update_meta(meta, PagedBatch([17, 17], [41, 61], [[[0, 1, 2], [3, 4, 5, 6]]], 16))
    assert _row_kv_lens(meta, 0) == [*range(25, 42), *range(45, 62)]    # the new step's lengths


@pytest.mark.parametrize("name", ["huginn-tiny", "ouro-tiny-gqa-bf16"])
def test_int8_engine_equals_the_cpu_int8_engine(name, single_thread):
    """Chunks of at most 8 tokens attended row by row and decode replayed from graphs (BSH with
    antiquant mode 5, lengths updated before each replay): the tokens of the CPU engine over int8 KV."""
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32")
    params = SamplingParams(max_tokens=case.meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True,
                            num_loops=case.meta.get("greedy_num_steps"), init_scale=0.0)
    tokens = {}
    for label, h, extra in (("cpu", hal.get("cpu"), {}), ("ascend", sim(), {"graphs": True})):
        engine = LLMEngine(model, h, EngineConfig(kv_dtype="int8", block_size=16, max_num_batched_tokens=8,
                                                  max_num_seqs=4, **extra))
        for i in range(case.num_prompts):
            engine.add_request(str(i), case.prompt(i), params)
        tokens[label] = {o.request_id: o.token_ids for o in engine.run_until_done()}
    backend = engine.runner.backend
    assert backend.name == "fia+int8" and engine.runner.graphs.captured
    assert backend.ops.counts["fused_infer_attention_int8"] and not backend.ops.counts["fused_infer_attention"]
    assert tokens["ascend"] == tokens["cpu"]
    with pytest.raises(ValueError, match=r"Use one of those \(kv_dtype=int8 on Ascend\)"):
        LLMEngine(model, sim(), EngineConfig(kv_dtype="fp8", block_size=16))


def test_a_prompts_only_chunk_is_captured_over_tables_of_its_own_width(single_thread):
    """The int8 prefill dequantizes every block its tables name, and a captured pass's tables are as
    wide as its capacity. A prompt without context now gets tables of its own width (Nanbeige's
    262,144-position default would have dequantized 2,050 blocks per layer-plane for a 20-token
    prompt); a later chunk past 16 tokens, whose captured tables would have room for max_model_len,
    runs eagerly over its own. The tokens are the CPU int8 engine's."""
    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompts = {"short": list(range(5, 25)), "chunked": list(range(7, 59))}   # 20; 32 + 20 tokens
    tokens = {}
    for label, h, graphs in (("cpu", hal.get("cpu"), False), ("ascend", sim(), True)):
        engine = LLMEngine(model, h, EngineConfig(kv_dtype="int8", block_size=16, max_num_batched_tokens=32,
                                                  max_num_seqs=1, max_model_len=256, graphs=graphs))
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, params)
        tokens[label] = {o.request_id: o.token_ids for o in engine.run_until_done()}
    widths = {(key[1], key[5]): cap.ctx.meta.block_tables.shape[-1]
              for key, cap in engine.runner.graphs.captured.items() if key[0] == "prefill"}
    # captured at start: both widths without context over tables of their own width (the 20-token
    # prompt replays the 32-token one), with context only up to 16 tokens (the 20-token last chunk ran
    # eagerly), over tables as wide as max_model_len
    assert widths == {(16, False): 2, (32, False): 3, (16, True): 18}
    assert engine.runner.backend.ops.counts["fused_infer_attention"]   # past ROW_QUERIES: dequantized blocks
    assert tokens["ascend"] == tokens["cpu"]


@pytest.mark.parametrize("graphs", [False, True])
def test_int8_speculation_pads_its_verify_pass_inside_the_scratch_blocks(graphs, single_thread):
    """A verify pass padded to its bucket gives its padding rows table entries; those past a row's
    blocks pointed past the runner's scratch blocks, and the int8 prefill path read whole tables
    (IndexError). Now they stay in the scratch blocks, and the tokens are the simple path's. Verify
    passes attend row by row, captured or not: no block is dequantized (a captured verify pass's
    tables have room for max_model_len)."""
    from runtime.config import SpeculativeConfig
    from runtime.execution.reference import generate_reference

    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")
    prompts = [[5, 9, 13, 17, 21], [7, 11, 15]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(model, sim(), EngineConfig(kv_dtype="int8", block_size=16, num_kv_blocks=16, max_num_seqs=2,
                                                  graphs=graphs, max_num_batched_tokens=4,
                                                  speculative=SpeculativeConfig(num_tokens=2, draft_loops=1)))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert [outs["0"], outs["1"]] == [generate_reference(model, p, params, kv_dtype=torch.int8)[0] for p in prompts]
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    counts = engine.runner.backend.ops.counts
    assert counts["fused_infer_attention_int8"] and not counts["fused_infer_attention"]
    if graphs:
        passes = [*engine.runner.graphs.chains, *engine.runner.graphs.captured]
        assert {key[0] for key in passes} & {"round", "verify"}, passes


def test_an_8bit_kv_format_the_hal_cannot_read_names_the_ones_it_can():
    from runtime.execution.quantization import resolve_kv_dtype

    with pytest.raises(ValueError, match="reads 8-bit KV as int8.*use kv_dtype=auto or int8$"):
        resolve_kv_dtype("fp8_e4m3fn", hal.get("ascend-sim"))
