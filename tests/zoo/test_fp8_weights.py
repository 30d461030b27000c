"""FP8 weights (zoo/fp8.py, zoo/fp8_loading.py): per-output-channel quantization and its error bound,
fused projections, the fn -> fnuz conversion, pre-quantized checkpoints in the compressed-tensors and
`quant_method: fp8` layouts, the W8A8 `torch._scaled_mm` path against its emulation, and the engine
with `weights_dtype=fp8` against the simple path on the same weights."""
import json

import pytest
import torch
from helpers import golden_case, golden_names, single_thread  # noqa: F401 (fixture)
from safetensors.torch import load_file, save_file

import hal
import zoo
from hal.cuda.fp8 import quantize_rows, scaled_mm_linear
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.execution.reference import generate_reference
from zoo.fp8 import Fp8Linear, Fp8Weight, convert_format, quantize_fp8, quantize_matrix
from zoo.fuse import fuse_projections
from zoo.layers import GQAttention

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


def _bound(x, w):
    """|x @ (w - w8).T| <= |x| @ |w - w8|.T, and each weight is within 2^-4 of itself plus half the
    subnormal step (2^-10 of its row's scale) after rounding to e4m3."""
    scale = w.abs().amax(1) / 448
    return x.abs() @ (w.abs() * 2**-4 + scale[:, None] * 2**-10).T * (1 + 1e-5) + 1e-6


def test_fp8_linear_error_and_fused_rows():
    lin = torch.nn.Linear(96, 80, bias=True)
    with torch.no_grad():
        lin.weight.mul_(torch.rand(80, 1) * 10)              # rows of very different scales
    x = torch.randn(7, 96)
    fp8 = Fp8Linear.from_linear(lin, FN)
    with torch.no_grad():
        y, want = fp8(x), lin(x)
    assert fp8.weight.dtype == FN and fp8.weight_scale.shape == (80,)
    assert ((y - want).abs() <= _bound(x, lin.weight.detach())).all()
    # a row's scale depends on that row only: q|k|v quantized as one matrix = quantized one by one
    attn = GQAttention(48, 4, 2, 12, 1e4)
    separate = [quantize_matrix(p.weight) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    fuse_projections(attn)
    assert quantize_fp8(attn) == 2                           # qkv (its parts view it) and o_proj
    assert isinstance(attn.qkv, Fp8Weight) and isinstance(attn.k_proj, Fp8Linear)
    together = torch.cat([s.weight for s in separate])
    assert torch.equal(attn.qkv.weight.view(torch.uint8), together.view(torch.uint8))
    assert attn.k_proj.weight.data_ptr() == attn.qkv.weight[48:].data_ptr()           # views, no copy


def test_fn_to_fnuz_keeps_every_value():
    w = torch.randn(64, 40)
    w[0, 0] = -0.0
    q, scale = quantize_matrix(w, FN)
    q2, scale2 = convert_format(q, scale, FNUZ)
    assert q2.dtype == FNUZ and torch.equal(q.float() * scale[:, None], q2.float() * scale2[:, None])
    back, back_scale = convert_format(q2, scale2, FN)       # the other way requantizes
    assert (back.float() * back_scale[:, None] - w).abs().max() <= w.abs().max() * 2**-3


def test_w8a8_scaled_mm_equals_its_emulation():
    """The `torch._scaled_mm` path of hal/cuda/fp8.py (which torch also runs on the CPU): activations
    quantized per row, products in fp32, bf16 out; equal to dequantize-then-matmul up to bf16 rounding."""
    x = (torch.randn(9, 64) * torch.rand(9, 1) * 4).bfloat16()
    w, s = quantize_matrix(torch.randn(48, 64) * 0.2)
    bias = torch.randn(48)
    xq, sx = quantize_rows(x)
    want = (xq.float() * sx) @ (w.float() * s[:, None]).T + bias
    got = scaled_mm_linear(x, w, s, bias)
    assert got.dtype == torch.bfloat16 and ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-2).all()


def _prequantized(tmp_path, model, layout):
    """Save `model` (FP8 linears) and rewrite its scales as `layout` stores them."""
    zoo.save_pretrained(model, tmp_path, dtype="float32")
    state = load_file(str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    names = [n[:-len(".weight_scale")] for n in state if n.endswith(".weight_scale")]
    for name in names:
        w = state[f"{name}.weight"].float() * state.pop(f"{name}.weight_scale")
        if layout == "tensor":                               # one scale per matrix, static input scale
            q, scale = quantize_matrix(w.flatten()[None], FN)
            state[f"{name}.weight"], state[f"{name}.weight_scale"] = q.view(w.shape), scale.reshape(())
            state[f"{name}.input_scale"] = torch.tensor(1.0)
        else:                                                # 16 x 16 blocks, inverse-named scales
            blocks = w.unflatten(0, (-1, 16)).unflatten(2, (-1, 16))                 # [N/16, 16, K/16, 16]
            scale = blocks.abs().amax((1, 3)) / 448
            q = (blocks / scale[:, None, :, None]).to(FN).flatten(2).flatten(0, 1)
            state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = q, scale
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"} | \
        ({"weight_block_size": [16, 16]} if layout == "block" else {})
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return names


@pytest.mark.parametrize("layout", ["channel", "tensor", "block"])
def test_prequantized_checkpoints_load(layout, tmp_path, single_thread):
    """compressed-tensors per channel (our own save) loads bit for bit; per-tensor scales exactly;
    block-wise scales requantized per channel, within one more e4m3 rounding."""
    case = golden_case("ouro-tiny")
    quantized = zoo.from_pretrained(case.path, dtype="float32", weights_dtype="fp8")
    if layout == "channel":
        zoo.save_pretrained(quantized, tmp_path, dtype="float32")
    else:
        names = _prequantized(tmp_path, quantized, layout)
    loaded = zoo.from_pretrained(tmp_path)
    linears = {n: m for n, m in loaded.named_modules() if isinstance(m, Fp8Linear)}
    assert len(linears) == 14 and "lm_head" not in linears
    if layout == "channel":
        for n, m in quantized.named_modules():
            if isinstance(m, Fp8Linear):
                assert torch.equal(linears[n].weight.view(torch.uint8), m.weight.view(torch.uint8)), n
                assert torch.equal(linears[n].weight_scale, m.weight_scale), n
        return
    stored = load_file(str(tmp_path / "model.safetensors"))
    for name in names:
        w, s = linears[name].weight.float(), linears[name].weight_scale
        if layout == "tensor":
            assert torch.equal(w * s[:, None], stored[f"{name}.weight"].float() * stored[f"{name}.weight_scale"])
        else:
            blocks = stored[f"{name}.weight_scale_inv"].repeat_interleave(16, 0).repeat_interleave(16, 1)
            exact = stored[f"{name}.weight"].float() * blocks
            assert ((w * s[:, None] - exact).abs() <= exact.abs() * 2**-4 + s[:, None] * 2**-10).all()
    (tmp_path / "config.json").write_text(json.dumps(
        json.loads((tmp_path / "config.json").read_text()) | {"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(zoo.CheckpointError, match="reads FP8 checkpoints"):
        zoo.from_pretrained(tmp_path)


@pytest.mark.parametrize("name", ["huginn-tiny", "nanbeige-tiny"])
def test_engine_with_fp8_weights_equals_the_simple_path(name, single_thread):
    """Weights quantized at engine start (after fusing q|k|v and gate|up): the engine's tokens are the
    simple path's on the same FP8 weights (the other two families' layers are Ouro's and Nanbeige's)."""
    case = golden_case(name)
    model = zoo.from_pretrained(case.path, dtype="float32")
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(weights_dtype="fp8", max_num_batched_tokens=7,
                                                            block_size=4))
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    assert all(isinstance(m.qkv, Fp8Weight) for m in model.modules() if isinstance(m, GQAttention))
    params = SamplingParams(max_tokens=case.meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True,
                            num_loops=case.meta.get("greedy_num_steps"), init_scale=0.0)
    for i in range(case.num_prompts):
        engine.add_request(str(i), case.prompt(i), params)
    outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
    agree = total = 0
    for i in range(case.num_prompts):
        assert outs[str(i)] == generate_reference(model, case.prompt(i), params)[0], f"prompt {i}"
        agree += sum(a == b for a, b in zip(outs[str(i)], case.greedy(i)))
        total += len(case.greedy(i))
    print(f"{name}: fp8 weights greedy agreement with float32 {agree}/{total}")


def test_fp8_weights_logit_error_is_bounded(single_thread):
    """Full-prompt logits with FP8 weights against the float32 golden, every case: the mean error
    within 25% of the logits' standard deviation and the largest within 1.5 (measured at most 16%
    and 1.02: these tiny models are deliberately sharp; docs/fp8.md has the numbers)."""
    for name in golden_names():
        case = golden_case(name)
        model = zoo.from_pretrained(case.path, dtype="float32", weights_dtype="fp8")
        loops = case.meta.get("greedy_num_steps") or model.default_num_loops
        kwargs = {"num_loops": loops} | ({"init_scale": 0.0} if name.startswith("huginn") else {})
        for i in range(case.num_prompts):
            want = case.tensors.get(f"logits_{i}", case.tensors.get(f"logits_{i}_steps{loops}"))
            with torch.no_grad():
                err = (model(torch.tensor([case.prompt(i)]), **kwargs).logits[0] - want).abs()
            assert 0 < err.mean() <= 0.25 * want.std() and err.max() <= 1.5 * want.std(), f"{name} prompt {i}"


def test_an_fp8_checkpoint_without_torch_dtype_keeps_its_other_weights_dtype(tmp_path, single_thread):
    """Its float32 scales outnumber the bf16 norms and embeddings, but do not pick the dtype."""
    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="bfloat16", weights_dtype="fp8")
    zoo.save_pretrained(model, tmp_path, dtype="bfloat16")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["torch_dtype"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert zoo.from_pretrained(tmp_path).model.embed_tokens.weight.dtype == torch.bfloat16


def test_block_scales_with_as_many_values_as_rows_are_block_scales(tmp_path, single_thread):
    """A compressed-tensors block scale `[N/16, K/16]` of a `[32, 256]` weight holds 32 values, as
    many as a per-channel scale: it must still dequantize by blocks."""
    config = dict(model_type="ouro", vocab_size=64, hidden_size=32, intermediate_size=256, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=4, total_ut_steps=2, max_position_embeddings=64,
                  rope_theta=10000.0, torch_dtype="float32")
    b = 16
    state, exact = {}, {}
    for name, tensor in zoo.from_config(config, seed=0).state_dict().items():
        module = name.rsplit(".", 1)[0]
        if not name.endswith("_proj.weight"):
            state[name] = tensor.contiguous()
            continue
        n, k = tensor.shape
        blocks = tensor.reshape(n // b, b, k // b, b).abs().amax(dim=(1, 3)) / 448.0
        full = blocks.repeat_interleave(b, 0).repeat_interleave(b, 1)
        state[name], state[module + ".weight_scale"] = (tensor / full).to(torch.float8_e4m3fn), blocks.contiguous()
        exact[module] = state[name].float() * full
    save_file(state, str(tmp_path / "model.safetensors"))
    weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [b, b], "symmetric": True,
               "dynamic": False}
    quant = {"quant_method": "compressed-tensors", "format": "float-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
             "ignore": ["lm_head", "model.early_exit_gate"]}
    (tmp_path / "config.json").write_text(json.dumps(config | {"quantization_config": quant}))
    loaded = zoo.from_pretrained(tmp_path)
    for module, weight in exact.items():
        linear = loaded.get_submodule(module)
        got = linear.weight.float() * linear.weight_scale[:, None]
        assert ((got - weight).abs().max() / weight.abs().max()).item() < 0.07, module     # one more e4m3 rounding


def test_fp8_tensors_other_than_e4m3_are_refused(tmp_path):
    """An e5m2 weight's scale would be ignored by the e4m3 loader: refused, naming the format."""
    case = golden_case("ouro-tiny")
    state = load_file(str(case.path / "model.safetensors"))
    name = next(n for n in state if n.endswith("down_proj.weight"))
    state[name] = state[name].to(torch.float8_e5m2)
    state[name[:-len("weight")] + "weight_scale"] = torch.ones(state[name].shape[0], 1)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((case.path / "config.json").read_text())
    with pytest.raises(zoo.CheckpointError, match="stores F8_E5M2 tensors"):
        zoo.from_pretrained(tmp_path)
