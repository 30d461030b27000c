"""The engine on the Triton backend (run by the Triton interpreter on the CPU): golden greedy tokens
through packed prefill, chunked prefill and padded decode graphs with in-place metadata updates."""
import torch

import zoo
from hal.cpu import CpuHal
from hal.kernels.backend import TritonPagedAttention
from interp import interpreter
from triton_hal import TritonOnCpu
from helpers import golden_case
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine


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


def test_row_kernel_rotary_in_the_engine_gives_the_two_launch_tokens(monkeypatch):
    """Multi-head decode on the row kernel in bf16 with context splits, graphs on (Ouro's NeoX rotary
    and Huginn's GPT-J pairs): the fused rotary + KV write (`attend.fuses_rotary`, lever 58) gives the
    greedy tokens of the two-launch path (rotary_kv_write, then the row kernel) token for token."""
    from hal.kernels import backend as backend_module
    from hal.kernels.configs import KernelConfig, configs_for
    from hal.kernels.ops import fused_ops

    configs = {**configs_for("default"), "attention_row_decode": KernelConfig(1, 16, 1, 2)}

    class RowsOnCpu(TritonOnCpu):
        def op(self, name):     # with a rotary op, layers hand q, k, v unrotated to attend_rotary
            return fused_ops(configs)["rotary"] if name == "rotary" else super().op(name)

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, seed=5)   # seed: Huginn's draw
    fused_steps = []
    real_fuses = backend_module.fuses_rotary
    for name in ("ouro-tiny", "huginn-tiny"):
        case = golden_case(name)
        model = zoo.from_pretrained(case.path, dtype="bfloat16")
        outs = {}
        for fused in (True, False):
            def fuses(*args, fused=fused):
                answer = fused and real_fuses(*args)
                fused_steps.append(answer)
                return answer

            monkeypatch.setattr(backend_module, "fuses_rotary", fuses)
            with interpreter(), torch.inference_mode():
                engine = LLMEngine(model, RowsOnCpu(configs=configs, num_compute_units=4),
                                   EngineConfig(block_size=4, max_num_batched_tokens=16, graphs=True))
                engine.add_request("0", case.prompt(0), params)
                outs[fused] = [o.token_ids for o in engine.run_until_done()]
            assert engine.runner.graphs.captured, "the padded decode path was not used"
        assert outs[True] == outs[False], name
    assert any(fused_steps), "no decode step took the fused path"


def test_long_prompts_replay_captured_fresh_prefills(monkeypatch):
    """Prompts past the short buckets replay captured prefills where they fit one (a medium bucket
    padded, a long one filled to within `MAX_LONG_PADDING`), captured over their own first batch (the
    scratch slots hold only padding), attending through the backend's fresh path (`MetaCapacity.fresh`)
    from `AttnCaps.fresh_min_tokens` on, over their own K/V on the paged kernel below, by the prompt's own
    length as its eager pass decides (a line inside a bucket captures it twice); a prompt that would pad a
    long bucket more runs eagerly; a short prompt whose bucket reaches past max_model_len fits the captured
    tables (it once raised "a block table has 4 blocks, more than max_blocks=3"). Greedy tokens are the
    eager pass's."""
    from runtime.execution import prefill_buckets, runner as runner_module

    # 16 / 32 / 64 tokens stand in for the short (<= 1K), medium (1.5K-4K) and long (8K+) ranges
    for name, value in (("SHORT", (16,)), ("MEDIUM", (32,)), ("LONG", (64,))):
        monkeypatch.setattr(prefill_buckets, name, value)

    def fresh_on_cpu():            # the fresh path from 30 tokens: inside the "medium" bucket
        return TritonOnCpu(fresh_attention="sdpa", fresh_min_tokens=30)

    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="bfloat16")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist()
               for n in (64, 60, 24, 31, 10, 9)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outs = {}
    for captured in (True, False):
        if not captured:
            monkeypatch.setattr(runner_module.ModelRunner, "chunk_bucket", lambda self, item: None)
        with interpreter(), torch.inference_mode():
            engine = LLMEngine(model, fresh_on_cpu(), EngineConfig(block_size=4, max_num_batched_tokens=64,
                                                                 max_model_len=66, graphs=True, max_num_seqs=1))
            # the fresh line inside the short bucket: both of its passes captured at start
            short = LLMEngine(model, TritonOnCpu(fresh_attention="sdpa", fresh_min_tokens=10),
                              EngineConfig(block_size=4, max_num_batched_tokens=64, max_model_len=12,
                                           graphs=True, max_num_seqs=1))
            short.runner.capture_at_start(model.default_num_loops, 12)    # as a GPU Hal's engine does
            at_start = {k[1:] for k in short.runner.graphs.captured if k[0] == "prefill"}
            outs[captured] = []
            for eng, prompt in zip((engine, engine, engine, engine, short, short), prompts):
                eng.add_request(str(len(prompt)), prompt, params)
                outs[captured] += [o.token_ids for o in eng.run_until_done()]
        if captured:
            runner, loops = engine.runner, model.default_num_loops
            planes = runner.layout.num_planes(loops)
            assert runner.env.num_scratch_slots < 32
            captures = runner.graphs.captured
            assert {k[1:] for k in captures if k[0] == "prefill"} == {
                (64, loops, planes, True, False), (32, loops, planes, False, False),
                (32, loops, planes, True, False)}
            assert captures[("prefill", 64, loops, planes, True, False)].ctx.meta.fresh_lens == (64,)
            # 31 tokens: fresh; 24 tokens: their own K/V
            assert captures[("prefill", 32, loops, planes, True, False)].ctx.meta.fresh_lens == (32,)
            medium = captures[("prefill", 32, loops, planes, False, False)].ctx.meta
            assert medium.fresh_lens is None and medium.own_kv
            short_captures = short.runner.graphs.captured
            assert {k[1:] for k in short_captures if k[0] == "prefill"} == at_start == {   # none on first use
                (16, loops, planes, False, False), (16, loops, planes, True, False),
                (16, loops, planes, False, True)}
            assert short_captures[("prefill", 16, loops, planes, True, False)].ctx.meta.fresh_lens == (16,)
    assert outs[True] == outs[False]


def test_packed_steps_through_triton_attention(monkeypatch):
    """Steps of several prompt chunks beside decodes replay one packed pass through the Triton
    backend: its meta built with a packed capacity (the prefill config, whatever the step's query
    lengths) and refilled for each step's mix, padded with sequences that have no tokens; the golden
    greedy tokens."""
    from runtime.execution.runner import ModelRunner

    packed = []
    original = ModelRunner._execute_packed
    monkeypatch.setattr(ModelRunner, "_execute_packed", lambda self, *a, **k: packed.append(a[1]) or original(self, *a, **k))
    case = golden_case("ouro-tiny-gqa-bf16")
    model = zoo.from_pretrained(case.path, dtype="float32")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with interpreter(), torch.inference_mode():
        engine = LLMEngine(model, TritonOnCpu(), EngineConfig(block_size=4, max_num_batched_tokens=20, graphs=True,
                                                               max_num_seqs=4))
        engine.add_request("0", case.prompt(0), params)
        engine.step()
        for i in range(1, 4):                # the golden prompts again: chunks of two at a time
            engine.add_request(str(i), case.prompt(i % case.num_prompts), params)
        outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    assert len(packed) >= 2 and all(shape.num_seqs == 5 for shape in packed), packed
    for i in range(4):
        assert outs[str(i)] == case.greedy(i % case.num_prompts)[:6]


def test_mixed_steps_decode_rows_on_the_row_kernel_packed_and_eager_alike(monkeypatch):
    """Prompts joining a decoding batch of a multi-head bf16 model, with the row kernel in the table:
    the decode rows of those mixed steps take the row kernel (lever 113) both in the packed captured
    pass (graphs on) and in the eager pass (graphs off), which give the same tokens."""
    from hal.kernels import attend
    from hal.kernels.configs import KernelConfig, configs_for
    from runtime.execution.runner import ModelRunner

    configs = {**configs_for("default"), "attention_row_decode": KernelConfig(1, 16, 1, 2)}

    mixed_launches, packed = [], []
    real_launches, real_packed = attend.launches_for, ModelRunner._execute_packed

    def counting(*args, **kwargs):
        launches = real_launches(*args, **kwargs)
        if kwargs.get("mixed") or (len(args) > 12 and args[12]):
            mixed_launches.append(len(launches))
        return launches

    monkeypatch.setattr(attend, "launches_for", counting)
    monkeypatch.setattr(ModelRunner, "_execute_packed", lambda self, *a, **k: packed.append(1) or real_packed(self, *a, **k))
    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="bfloat16")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        with interpreter(), torch.inference_mode():
            engine = LLMEngine(model, TritonOnCpu(configs=configs, num_compute_units=4),
                               EngineConfig(block_size=4, max_num_batched_tokens=24, graphs=graphs,
                                            max_num_seqs=4))
            engine.add_request("0", case.prompt(0), params)
            engine.step()
            for i in range(1, 4):            # prompts joining request 0's decodes, two chunks a step
                engine.add_request(str(i), case.prompt(i % case.num_prompts), params)
            outs[graphs] = {o.request_id: o.token_ids for o in engine.run_until_done()}
        if graphs:
            assert packed, "no step ran the packed pass"
            assert mixed_launches and all(n == 2 for n in mixed_launches), mixed_launches
            num_packed = len(mixed_launches)
    assert len(mixed_launches) > num_packed, "no eager mixed step"
    assert outs[True] == outs[False]


def test_fp8_prompts_attend_over_their_own_kv_with_graphs_and_without(monkeypatch):
    """Lever 135 in the engine: over an FP8 cache, prompts (captured short prefills with graphs on, the
    same padded passes run eagerly with graphs off) attend on the 16-bit tile over the K/V their write
    hands back, decode steps over the cache; graphs on and off give the same greedy tokens, and each
    prompt's first token is the torch reference's over the same FP8 cache."""
    own = []
    real = TritonPagedAttention._own_kv_attention
    monkeypatch.setattr(TritonPagedAttention, "_own_kv_attention",
                        lambda self, *a, **k: own.append(a[0].shape[0]) or real(self, *a, **k))

    case = golden_case("ouro-tiny")
    model = zoo.from_pretrained(case.path, dtype="bfloat16")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)   # decode steps: other tests'
    outs = {}
    for graphs in (True, False):
        own.clear()
        with interpreter(), torch.inference_mode():
            # one request at a time: each prompt a pass of its own (several would share a packed one)
            engine = LLMEngine(model, TritonOnCpu(), EngineConfig(block_size=4, graphs=graphs, kv_dtype="fp8",
                                                               max_num_seqs=1))
            assert engine.runner.backend.kv_layout is not None
            for i in range(case.num_prompts):
                engine.add_request(str(i), case.prompt(i), params)
            outs[graphs] = {o.request_id: o.token_ids for o in engine.run_until_done()}
        assert own and all(n >= 16 for n in own), own          # the prompts' padded widths
    assert outs[True] == outs[False]
    with torch.inference_mode():                 # the torch reference over the same FP8 cache format
        engine = LLMEngine(model, CpuHal(), EngineConfig(block_size=4, kv_dtype="fp8", max_num_seqs=1))
        for i in range(case.num_prompts):
            engine.add_request(str(i), case.prompt(i), params)
        reference = {o.request_id: o.token_ids for o in engine.run_until_done()}
    print("own K/V against the reference:", outs[True], reference)
    assert all(outs[True][str(i)][0] == reference[str(i)][0] for i in range(case.num_prompts))
