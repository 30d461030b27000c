"""The zoo families with every fused decode op of the CUDA/ROCm Hals (hal/kernels, run by the Triton
interpreter): the wiring in zoo/layers.py and the families, through the dense context and through
the engine's paged context with graphs."""
from __future__ import annotations

import collections
import contextlib
import types

import pytest
import torch

import zoo
from zoo.context import ModelOps
from zoo.fuse import fuse_projections
from hal.kernels.backend import TritonPagedAttention
from hal.kernels.configs import configs_for
from hal.kernels.gemv_ops import gemv_ops
from hal.kernels.ops import fused_ops
from helpers import golden_case
from norm_ops import StreamAdds, huginn_launches, nanbeige_launches
from triton_hal import TritonOnCpu
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.usefixtures("interpreted")

SMALL_OPS = ("rms_norm", "norm_add_norm", "rotary", "silu_and_mul")
PROJECTION_OPS = ("linear", "rms_norm_linear", "silu_mul_linear", "norm_residual_linear")
CASES = ["ouro-tiny-gqa-bf16", "nanbeige-tiny", "huginn-tiny"]


class TritonOpsOnCpu(TritonOnCpu):
    """The CPU Hal with the CUDA/ROCm Hals' Triton ops `names` (interpreted) and Triton attention;
    `calls` counts the ops' calls by name."""

    def __init__(self, names=SMALL_OPS + PROJECTION_OPS, adds: StreamAdds | None = None):
        super().__init__()
        self.names, self.calls, self.adds = tuple(names), collections.Counter(), adds
        self.table = {**fused_ops(configs_for("default")), **gemv_ops(configs_for("default"), 4)}

    def op(self, name):
        if name not in self.names:
            return None
        fn = self.table[name]

        def counted(*args, **kwargs):
            self.calls[name] += 1
            with self.adds.paused() if self.adds is not None else contextlib.nullcontext():
                return fn(*args, **kwargs)
        return counted


def _model(name: str, dtype: str):
    model = zoo.from_pretrained(golden_case(name).path, dtype=dtype)
    return fuse_projections(model.eval())


def _logits(model, ids: torch.Tensor, hal=None) -> torch.Tensor:
    kwargs = {"init_scale": 0.0} if "init_scale" in model.forward.__code__.co_varnames else {}
    with torch.inference_mode():
        return model(ids, ops=ModelOps(hal), **kwargs).logits.float()


@pytest.mark.parametrize("name", CASES)
def test_projection_ops_are_the_unfused_path_in_float32(name):
    """float32 (golden runs): the projection ops take the unfused kernels, bit for bit."""
    model = _model(name, "float32")
    ids = torch.tensor([golden_case(name).prompt(0)[:6]])
    plain = _logits(model, ids, TritonOpsOnCpu(SMALL_OPS))
    hal = TritonOpsOnCpu()
    assert torch.equal(_logits(model, ids, hal), plain)
    assert {"rms_norm_linear", "silu_mul_linear"} <= set(hal.calls), hal.calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["ouro-tiny", "ouro-tiny-gqa-bf16"])
def test_norm_add_norm_gives_ouro_the_logits_of_the_norm_launches_it_replaces(name, dtype):
    """Ouro's sandwich norms through the norm_add_norm kernel (inside each layer, across layers, into
    the loop's final norm): bit for bit the logits of the rms_norm kernels, with 2 norm launches per
    layer and loop plus the first layer's input norm, where those take 4 per layer plus the final norm."""
    model = _model(name, dtype)
    ids = torch.tensor([golden_case(name).prompt(0)[:6]])
    unfused = TritonOpsOnCpu(tuple(n for n in SMALL_OPS if n != "norm_add_norm"))
    hal = TritonOpsOnCpu(SMALL_OPS)
    assert torch.equal(_logits(model, ids, hal), _logits(model, ids, unfused))
    layers, loops = model.config.num_hidden_layers, model.config.total_ut_steps
    assert unfused.calls["rms_norm"] == (4 * layers + 1) * loops, unfused.calls
    assert (hal.calls["norm_add_norm"], hal.calls["rms_norm"]) == (2 * layers * loops, loops), hal.calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["huginn-tiny", "nanbeige-tiny"])
def test_norm_add_norm_gives_huginn_and_nanbeige_the_logits_of_the_launches_it_replaces(name, dtype):
    """Huginn's sandwich blocks (sum_first) and Nanbeige's pre-norm layers (no post-norm) through the
    norm_add_norm kernel, inside blocks/layers and across them: bit for bit the logits of the rms_norm
    kernels and torch's adds, with the launch counts of tests/norm_ops.py (2 per block or layer where
    Huginn takes 6, Nanbeige 4)."""
    model = _model(name, dtype)
    ids = torch.tensor([golden_case(name).prompt(0)[:6]])

    def run(names):
        with StreamAdds(model.config.hidden_size if name == "nanbeige-tiny" else model.config.n_embd) as adds:
            hal = TritonOpsOnCpu(names, adds)
            logits = _logits(model, ids, hal)
        return logits, {**{n: hal.calls[n] for n in ("rms_norm", "norm_add_norm") if hal.calls[n]},
                        "add": adds.count}

    unfused, unfused_calls = run(tuple(n for n in SMALL_OPS if n != "norm_add_norm"))
    fused, fused_calls = run(SMALL_OPS)
    assert torch.equal(fused, unfused)
    if name == "huginn-tiny":
        counts = huginn_launches(model.config, model.config.mean_recurrence, coda_calls=1)
    else:
        counts = nanbeige_launches(model.config, model.config.num_loops)
    assert unfused_calls == counts["unfused"] and fused_calls == counts["fused"], (unfused_calls, fused_calls)


@pytest.mark.parametrize("name", CASES)
def test_fused_bf16_is_as_close_to_float32_as_unfused(name):
    """bf16 decode-sized batches (6 rows) through the fused kernels: no further from the float32
    logits than the unfused bf16 path (the kernels round where torch rounds; only sum orders differ)."""
    ids = torch.tensor([golden_case(name).prompt(0)[:6]])
    truth = _logits(_model(name, "float32"), ids)
    model = _model(name, "bfloat16")
    plain_err = (_logits(model, ids, TritonOpsOnCpu(SMALL_OPS)) - truth).abs().max().item()
    hal = TritonOpsOnCpu()
    fused_err = (_logits(model, ids, hal) - truth).abs().max().item()
    sandwich = {"ouro-tiny-gqa-bf16", "huginn-tiny"}
    expected = {"rms_norm_linear", "silu_mul_linear"} | ({"norm_residual_linear"} if name in sandwich else {"linear"})
    assert expected <= set(hal.calls), hal.calls
    assert fused_err <= 1.5 * plain_err + 2e-2, f"{name}: fused {fused_err:.3g} vs unfused {plain_err:.3g}"


def test_engine_with_fused_ops_graphs_equal_eager_bf16(monkeypatch):
    """Decode through every fused op and the rotary + KV-write kernel: graphs on and off give the
    same tokens (the same kernels either way)."""
    case = golden_case("ouro-tiny-gqa-bf16")
    model = _model(case.name, "bfloat16")
    fused_writes = collections.Counter()
    write = TritonPagedAttention.attend_rotary

    def counted_write(self, *args):
        fused_writes["attend_rotary"] += 1
        return write(self, *args)

    monkeypatch.setattr(TritonPagedAttention, "attend_rotary", counted_write)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, num_loops=1)   # the interpreter is slow
    outs, hal = {}, TritonOpsOnCpu()
    with torch.inference_mode():
        for graphs in (False, True):
            engine = LLMEngine(model, hal, EngineConfig(block_size=4, max_num_batched_tokens=16, graphs=graphs))
            engine.add_request("0", case.prompt(0)[:5], params)
            outs[graphs] = [o.token_ids for o in engine.run_until_done()]
    assert outs[True] == outs[False]
    assert fused_writes["attend_rotary"] and hal.calls["norm_residual_linear"], (fused_writes, hal.calls)


@pytest.mark.parametrize("name", ["huginn-tiny", "nanbeige-tiny"])
def test_engine_with_norm_add_norm_decodes_huginn_and_nanbeige_alike(name):
    """Through the engine's paged context (prefill, then decode rows through Huginn's coda), graphs on:
    with norm_add_norm the greedy tokens of the rms_norm kernels and torch's adds, eagerly."""
    case = golden_case(name)
    model = _model(name, "bfloat16")
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, num_loops=1, init_scale=0.0)
    outs, fused = {}, TritonOpsOnCpu(SMALL_OPS)
    unfused = TritonOpsOnCpu(tuple(n for n in SMALL_OPS if n != "norm_add_norm"))
    with torch.inference_mode():
        for hal, graphs in ((unfused, False), (fused, True)):
            config = EngineConfig(block_size=4, max_num_batched_tokens=16, graphs=graphs)
            engine = LLMEngine(model, hal, config)
            engine.add_request("0", case.prompt(0)[:5], params)
            outs[graphs] = [o.token_ids for o in engine.run_until_done()]
    assert outs[True] == outs[False]
    assert fused.calls["norm_add_norm"] and not unfused.calls["norm_add_norm"], fused.calls


@pytest.mark.parametrize("name", ["huginn-tiny", "nanbeige-tiny"])
def test_projections_the_slice_kernel_does_not_take_leave_the_layers_as_without_them(name):
    """The CUDA Hal's default offers the projection ops for one row at the shapes its whole-slice
    kernel takes (hal/kernels/gemv_ops.py). Where it takes none of a model's (K in several slices),
    the model computes what it computes without them, bit for bit, and a pre-norm layer keeps its
    norm_add_norm boundaries."""
    from hal.kernels.configs import KernelConfig
    from zoo.layers import fuses_pre_norm_boundaries

    model = _model(name, "bfloat16")
    ids = torch.tensor([golden_case(name).prompt(0)[:1]])
    hal = TritonOpsOnCpu(SMALL_OPS + PROJECTION_OPS + ("projection_takes",))
    configs = {**configs_for("default"), "gemv_slice": KernelConfig(1, 4, 4, 1, block_k=16, split_k=1)}
    hal.table.update(gemv_ops(configs, 4, max_rows=1))
    assert torch.equal(_logits(model, ids, hal), _logits(model, ids, TritonOpsOnCpu(SMALL_OPS)))
    h = torch.zeros(1, 1, model.config.hidden_size if name == "nanbeige-tiny" else model.config.n_embd)
    with torch.inference_mode():
        assert fuses_pre_norm_boundaries(types.SimpleNamespace(ops=ModelOps(hal)), h)
    # where the slice kernel takes a one-row projection after a norm, the norm would be a launch of
    # its own: a pre-norm layer keeps its boundaries then too (residual add and norm in one launch)
    wide = TritonOpsOnCpu(SMALL_OPS + PROJECTION_OPS + ("projection_takes",))
    one_slice = KernelConfig(1, 4, 4, 1, block_k=1024, split_k=1)
    wide.table.update(gemv_ops({**configs, "gemv_slice": one_slice}, 4, max_rows=1))
    with torch.inference_mode():
        assert fuses_pre_norm_boundaries(types.SimpleNamespace(ops=ModelOps(wide)), h)


@pytest.mark.parametrize("name", CASES)
def test_fp8_down_projections_take_swiglu_in_their_prologue(name):
    """FP8 weights at one row with the CUDA/ROCm Hals' FP8 ops (hal/cuda/fp8.py): every MLP's down
    projection is one `silu_mul_fp8_linear` call and no silu_and_mul runs; the logits are those of
    silu_and_mul, then fp8_linear, up to silu's one-ulp moves."""
    from hal.cuda.fp8 import fp8_linear_op, silu_mul_fp8_linear_op
    from zoo.fp8 import Fp8Linear

    case = golden_case(name)
    model = fuse_projections(zoo.from_pretrained(case.path, dtype="bfloat16", weights_dtype="fp8").eval())
    ids = torch.tensor([case.prompt(0)[:1]])
    configs = configs_for("default")

    def run(names):
        hal = TritonOpsOnCpu(SMALL_OPS + names)
        linear, silu = fp8_linear_op("gfx942", configs, True), hal.table["silu_and_mul"]
        hal.table.update(fp8_linear=linear,
                         silu_mul_fp8_linear=silu_mul_fp8_linear_op("gfx942", configs, linear, silu))
        for module in model.modules():
            if isinstance(module, Fp8Linear):
                module.ops = ModelOps(hal)                 # what the engine binds (quantize_fp8(..., ops=))
        return _logits(model, ids, hal), hal.calls

    fused, fused_calls = run(("fp8_linear", "silu_mul_fp8_linear"))
    unfused, unfused_calls = run(("fp8_linear",))
    downs = unfused_calls["silu_and_mul"]
    assert "silu_and_mul" not in fused_calls and fused_calls["silu_mul_fp8_linear"] == downs > 0
    assert fused_calls["fp8_linear"] == unfused_calls["fp8_linear"] - downs > 0
    err = (fused - unfused).abs().max().item()
    print(f"{name}: fused vs unfused FP8 down projections, max logit difference {err:.3g}")
    assert err <= 2e-2 * unfused.abs().max().item(), err


@pytest.mark.parametrize("name", CASES)
def test_fp8_prompt_products_take_their_input_quantized_by_the_norm_boundary(name, monkeypatch):
    """FP8 weights on the sm_90 table's ops, a 12-row prompt (past the decode GEMV: `_scaled_mm`, which
    the CPU's torch runs too): the boundaries before q|k|v (across layers) and gate|up quantize their rows
    (`norm_add_norm_fp8`, lever 132), so those products launch no `quantize_rows`, and the logits are the
    unfused path's bit for bit."""
    from hal.cuda.fp8 import fp8_linear_op, norm_add_norm_fp8_op
    from hal.kernels import fp8_rows
    from zoo.fp8 import Fp8Linear

    case = golden_case(name)
    model = fuse_projections(zoo.from_pretrained(case.path, dtype="bfloat16", weights_dtype="fp8").eval())
    ids = torch.tensor([(case.prompt(0) * 4)[:12]])
    sm_90 = configs_for("sm_90")
    quantized = collections.Counter()
    quantize_rows = fp8_rows.quantize_rows
    monkeypatch.setattr(fp8_rows, "quantize_rows", lambda *a, **k: quantized.update(["rows"]) or quantize_rows(*a, **k))

    def run(names):
        quantized.clear()
        hal = TritonOpsOnCpu(SMALL_OPS + names)
        hal.table.update(fp8_linear=fp8_linear_op("sm_90", sm_90, True),
                         norm_add_norm_fp8=norm_add_norm_fp8_op("sm_90", sm_90))
        for module in model.modules():
            if isinstance(module, Fp8Linear):
                module.ops = ModelOps(hal)                 # what the engine binds (quantize_fp8(..., ops=))
        return _logits(model, ids, hal), hal.calls, quantized["rows"]

    fused, calls, launches = run(("fp8_linear", "norm_add_norm_fp8"))
    unfused, unfused_calls, unfused_launches = run(("fp8_linear",))
    assert torch.equal(fused, unfused)
    assert calls["norm_add_norm_fp8"] > 0 and calls["fp8_linear"] == unfused_calls["fp8_linear"]
    boundaries = unfused_calls["norm_add_norm"] - calls["norm_add_norm"]    # taken by norm_add_norm_fp8
    assert boundaries == calls["norm_add_norm_fp8"] and launches == unfused_launches - boundaries > 0


def _slice_forms(monkeypatch) -> collections.Counter:
    """Counts the slice kernel's launches by form ("tensor cores", "w8a8", "cuda cores") as gemv_ops makes them."""
    import hal.kernels.gemv_ops as gemv_ops_module

    forms = collections.Counter()
    forms.rows = collections.Counter()          # launches by the rows of x
    launch = gemv_ops_module.slice_gemv_launch

    def counted(*args, **kwargs):
        forms["w8a8" if kwargs.get("a8") else "tensor cores" if kwargs.get("tensor_cores") else "cuda cores"] += 1
        forms.rows[args[0].shape[0]] += 1
        return launch(*args, **kwargs)

    monkeypatch.setattr(gemv_ops_module, "slice_gemv_launch", counted)
    return forms


def test_engine_on_the_sm_90_table_decodes_the_tokens_of_the_unfused_kernels(monkeypatch):
    """The CUDA Hal's decode projections as the sm_90 table has them (hal/kernels/configs.py: the slice
    kernel, and its tensor-core entry `gemv_slice_tc` for every product it takes, one row or two; the
    Hal's `max_rows` 1) through the engine with graphs: the greedy tokens of the unfused kernels, run
    eagerly. A request alone decodes one-row steps, two together two-row steps."""
    case = golden_case("ouro-tiny-gqa-bf16")
    model = _model(case.name, "bfloat16")
    forms = _slice_forms(monkeypatch)
    sm_90 = configs_for("sm_90")
    assert sm_90["gemv_slice_tc"].block_m == 2
    table = TritonOpsOnCpu(SMALL_OPS + PROJECTION_OPS + ("projection_takes",))
    table.table = {**fused_ops(sm_90), **gemv_ops(sm_90, 132, max_rows=1)}
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, num_loops=2)
    outs = {}
    with torch.inference_mode():
        for hal, graphs in ((TritonOpsOnCpu(SMALL_OPS), False), (table, True)):
            engine = LLMEngine(model, hal, EngineConfig(block_size=4, max_num_batched_tokens=16, graphs=graphs))
            engine.add_request("0", case.prompt(0)[:5], params)
            outs[graphs] = [o.token_ids for o in engine.run_until_done()]
            for i in (1, 2):
                engine.add_request(str(i), case.prompt(i % case.num_prompts)[:5], params)
            outs[graphs] += [o.token_ids for o in sorted(engine.run_until_done(), key=lambda o: o.request_id)]
    assert outs[True] == outs[False]
    assert forms["tensor cores"] > 0 and set(forms) == {"tensor cores"}, forms
    assert forms.rows[1] > 0 and forms.rows[2] > 0 and set(forms.rows) == {1, 2}, forms.rows


def test_engine_on_the_sm_90_table_decodes_fp8_weights_with_the_w8a8_slices(monkeypatch):
    """FP8 weights through the engine with the sm_90 table's `fp8_linear` (hal/cuda/fp8.py): the one-row
    products on the W8A8 slices (`gemv_slice_w8a8`, x quantized per 512-wide slice), the prompt's rows on
    the W8A16 decode GEMV: graphs on decode the tokens of the same kernels run eagerly. (Against the
    weights dequantized in torch the third token of the second prompt moves: [146, 30, 30] against
    [146, 30, 154], the activation rounding W8A8 adds; its kernels' numerics are
    tests/kernels/test_interp_gemv.py's, against the per-slice reference.)"""
    from hal.cuda.fp8 import fp8_linear_op, silu_mul_fp8_linear_op

    case = golden_case("ouro-tiny-gqa-bf16")
    model = fuse_projections(zoo.from_pretrained(case.path, dtype="bfloat16", weights_dtype="fp8").eval())
    forms = _slice_forms(monkeypatch)
    sm_90 = configs_for("sm_90")
    table = TritonOpsOnCpu(SMALL_OPS + ("fp8_linear", "silu_mul_fp8_linear"))
    linear = fp8_linear_op("sm_90", sm_90, True)
    table.table.update(fp8_linear=linear,
                       silu_mul_fp8_linear=silu_mul_fp8_linear_op("sm_90", sm_90, linear,
                                                                         table.table["silu_and_mul"]))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, num_loops=2)
    outs = {}
    with torch.inference_mode():
        for graphs in (False, True):
            engine = LLMEngine(model, table, EngineConfig(block_size=4, max_num_batched_tokens=16, graphs=graphs))
            engine.add_request("1", case.prompt(1)[:5], params)
            outs[graphs] = [o.token_ids for o in engine.run_until_done()]
            assert engine.runner.graphs.captured or not graphs
    assert outs[True] == outs[False]
    assert forms["w8a8"] > 0 and set(forms) == {"w8a8"}, forms
