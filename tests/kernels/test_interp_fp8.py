"""FP8 KV cache and FP8 linears in hal/kernels under the Triton interpreter, against the CPU
reference: the quantizing KV write stores the reference's bytes exactly (e4m3fn as on H200/gfx950,
e4m3fnuz as on gfx942), attention over an FP8 cache matches the reference's dequantize-then-attend,
and the W8A16 linear kernel matches dequantize-then-matmul."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from helpers import golden_case
from paged_cases import random_case
from triton_hal import TritonOnCpu

import zoo
from hal.cpu import CpuHal
from hal.common.torch_attention import TorchPagedAttention
from hal.kernels.backend import TritonPagedAttention
from hal.kernels.configs import KernelConfig, configs_for
from hal.cuda.fp8 import fp8_linear_op, silu_mul_fp8_linear_op
from hal.kernels import fp8_rows as fp8_row_kernels
from hal.kernels import gemv_ops  # noqa: F401 (imported outside the interpreter, as xcompile needs it)
from hal.kernels.fp8_linear import fp8_linear
from hal.kernels.fp8_rows import norm_add_norm_quantize, quantize_rows, silu_mul_quantize_rows
from hal.kernels.norms import norm_add_norm
from hal.kernels.ops import silu_and_mul
from hal.common.kv_quant import quantize
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.usefixtures("interpreted")

CPU = torch.device("cpu")
FORMATS = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
FAST_WRITE = KernelConfig(32, 1, 4, 1)


def _pair(heads, kv_heads, head_dim, dtype, kv_dtype, block_size=16, num_compute_units=4, configs=None):
    configs = {**configs_for("default"), **(configs or {}), "kv_write": FAST_WRITE}
    triton = TritonPagedAttention(heads, kv_heads, head_dim, dtype, CPU, block_size, configs=configs,
                                  num_compute_units=num_compute_units, kv_dtype=kv_dtype)
    reference = TorchPagedAttention(heads, kv_heads, head_dim, torch.float32, CPU, block_size, kv_dtype=kv_dtype)
    return triton, reference


def _filled(backend, reference, case):
    """Both caches after writing the case's whole history (every plane)."""
    cache = torch.zeros(backend.kv_cache_shape(case.num_blocks), dtype=backend.kv_cache_dtype)
    ref_cache = torch.zeros(reference.kv_cache_shape(case.num_blocks), dtype=reference.kv_cache_dtype)
    history, ref_history = backend.build_meta(case.history), reference.build_meta(case.history)
    for p in range(len(case.step.block_tables)):
        backend.write_kv(case.keys[p], case.values[p], cache, history, p)
        reference.write_kv(case.keys[p].float(), case.values[p].float(), ref_cache, ref_history, p)
    return cache, ref_cache


@pytest.mark.parametrize("kv_dtype", FORMATS, ids=["e4m3fn", "e4m3fnuz"])
def test_quantizing_write_stores_the_reference_bytes(kv_dtype):
    """Values and scales bit for bit, GQA with an odd head dim, tokens skipped by slot -1."""
    case = random_case(random.Random(), 6, 3, 40, torch.float32, num_planes=2)
    backend, reference = _pair(6, 3, 40, torch.float32, kv_dtype)
    cache, ref_cache = _filled(backend, reference, case)
    assert torch.equal(cache, ref_cache)
    # a bf16 model's keys quantize from their exact float32 values, the same bytes again
    case16 = case._replace(keys=case.keys.bfloat16(), values=case.values.bfloat16())
    backend16, reference16 = _pair(6, 3, 40, torch.bfloat16, kv_dtype)
    cache16, ref16 = _filled(backend16, reference16, case16)
    assert torch.equal(cache16, ref16)
    written = backend.kv_layout.scales(cache) > 0
    assert written.sum() == 2 * 2 * sum(case.history.seq_lens) * 3, "every written (token, head) has a scale"


@pytest.mark.parametrize("kv_dtype", FORMATS, ids=["e4m3fn", "e4m3fnuz"])
def test_quantizing_write_at_the_ends_of_the_scale_range(kv_dtype):
    """Rows of subnormal, huge and zero magnitude, float32 and bf16 keys: the writers multiply by the
    exact inverse of the power-of-two scale where the reference divides, and store the same bytes."""
    for dtype in (torch.float32, torch.bfloat16):
        case = random_case(random.Random(5), 4, 2, 32, dtype, num_planes=1)
        keys, values = case.keys.clone(), case.values.clone()
        keys[0, 0::4] *= 1e-39          # subnormal values: the smallest scale, 2^-126
        keys[0, 1::4] *= 1e37 if dtype == torch.float32 else 1e30       # near the largest
        values[0, 2::4] = 0.0           # scale 1, zero values
        values[0, 3::4] *= 3e-45 if dtype == torch.float32 else 1e-40   # a few subnormal steps
        case = case._replace(keys=keys, values=values)
        backend, reference = _pair(4, 2, 32, dtype, kv_dtype)
        cache, ref_cache = _filled(backend, reference, case)
        assert torch.equal(cache, ref_cache), dtype


@pytest.mark.parametrize("kv_dtype,dtype", [(torch.float8_e4m3fn, torch.bfloat16),
                                             (torch.float8_e4m3fnuz, torch.float32)],
                         ids=["e4m3fn-bf16", "e4m3fnuz-fp32"])
def test_fp8_attention_matches_reference(kv_dtype, dtype):
    """Prefill, chunked prefill and decode over an FP8 cache: the kernel applies each key's scales
    inside the products; the reference dequantizes first."""
    rng = random.Random()
    case = random_case(rng, 8, 2, 40, dtype)
    backend, reference = _pair(8, 2, 40, dtype, kv_dtype)
    cache, ref_cache = _filled(backend, reference, case)
    out = backend.forward(case.q, cache, backend.build_meta(case.step), 1, 40 ** -0.5)
    ref = reference.forward(case.q.float(), ref_cache, reference.build_meta(case.step), 1, 40 ** -0.5)
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max error {err:.2e}"


def test_sm90_fp8_prefill_tile_matches_reference():
    """The sm_90 table's prefill tile over an FP8 cache (64 query rows x 64 keys, lever 130) at Ouro's head
    size: a prompt without context and a chunk after 80 tokens of it, against dequantize-then-attend."""
    rng = random.Random(0)
    tile = {"attention_prefill_fp8": configs_for("sm_90")["attention_prefill_fp8"]}
    case = random_case(rng, 4, 4, 128, torch.bfloat16, seq_lens=[150, 70], query_lens=[70, 70])
    backend, reference = _pair(4, 4, 128, torch.bfloat16, torch.float8_e4m3fn, configs=tile)
    cache, ref_cache = _filled(backend, reference, case)
    out = backend.forward(case.q, cache, backend.build_meta(case.step), 0, 128 ** -0.5)
    ref = reference.forward(case.q.float(), ref_cache, reference.build_meta(case.step), 0, 128 ** -0.5)
    assert (out.float() - ref).abs().max().item() <= TOLERANCE[torch.bfloat16]


def test_fp8_decode_split_matches_reference():
    """Decode takes the context split and the reduce; the scales ride along every split."""
    rng = random.Random()
    case = random_case(rng, 4, 2, 64, torch.bfloat16, seq_lens=[rng.randint(40, 90), 1, 70],
                       query_lens=[1, 1, 1])
    backend, reference = _pair(4, 2, 64, torch.bfloat16, torch.float8_e4m3fn, num_compute_units=16)
    cache, ref_cache = _filled(backend, reference, case)
    out = backend.forward(case.q, cache, backend.build_meta(case.step), 0, 0.125)
    ref = reference.forward(case.q.float(), ref_cache, reference.build_meta(case.step), 0, 0.125)
    assert (out.float() - ref).abs().max().item() <= TOLERANCE[torch.bfloat16]


def test_triton_refuses_int8_kv():
    with pytest.raises(ValueError, match="FP8"):
        TritonPagedAttention(4, 2, 16, torch.bfloat16, CPU, 16, kv_dtype=torch.int8)


@pytest.mark.parametrize("fp8", FORMATS, ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (3, 96, 80)), (torch.float32, (33, 64, 48))],
                         ids=["bf16-decode", "fp32-prefill"])
def test_fp8_linear_kernel_matches_dequantized_matmul(fp8, dtype, shape):
    """W8A16: FP8 weight tiles widen to x's dtype, float32 accumulation, the row scales applied to the
    accumulator; ragged M, N, K (masked tiles), with a bias."""
    m, n, k = shape
    x = torch.randn(m, k).to(dtype)
    weight, scale = quantize(torch.randn(n, k) * 0.05, fp8)
    bias = torch.randn(n)
    out = fp8_linear(x, weight, scale, bias, KernelConfig(16, 32, 4, 1))
    ref = x.float() @ (weight.float() * scale[:, None]).T + bias
    assert out.dtype == dtype and out.shape == (m, n)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2 * ref.abs().max().item()
    assert (out.float() - ref).abs().max().item() <= tolerance


def test_fp8_linear_kernel_is_exact_at_the_config_s_block_k():
    """A config's `block_k` is the K step (lever 129's prompt tiles): K = 200 in steps of 128 (the second
    ragged) gives the dequantized product, as the default step of 64 does."""
    x = torch.randn(40, 200)
    weight, scale = quantize(torch.randn(72, 200) * 0.05, torch.float8_e4m3fn)
    ref = x @ (weight.float() * scale[:, None]).T
    for config in (KernelConfig(64, 32, 4, 2, block_k=128), KernelConfig(32, 64, 4, 2)):
        assert (fp8_linear(x, weight, scale, None, config) - ref).abs().max().item() <= 1e-5


def test_w8a8_tile_kernel_multiplies_quantized_rows():
    """Lever 134's probe form of the tile kernel: rows already quantized (`QuantizedRows`) times the FP8
    weight on FP8 products, both scales after the sum: the float64 product of the same quantized values to
    bf16's rounding, out in the rows' dtype; rows in another FP8 format than the weight's are refused."""
    from hal.common.quantized_rows import QuantizedRows

    x = (torch.randn(40, 256) * torch.rand(40, 1) * 4).bfloat16()
    weight, scale = quantize(torch.randn(96, 256) * 0.05, torch.float8_e4m3fn)
    rows = QuantizedRows(*quantize_rows(x), torch.bfloat16)
    got = fp8_linear(rows, weight, scale, None, KernelConfig(16, 32, 4, 1, block_k=64))
    ref = (rows.data.double() * rows.scale.double()) @ (weight.double() * scale.double()[:, None]).T
    assert got.dtype == torch.bfloat16 and got.shape == (40, 96)
    assert ((got.double() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-3).all()
    fnuz = QuantizedRows(rows.data.view(torch.uint8).view(torch.float8_e4m3fnuz), rows.scale, torch.bfloat16)
    with pytest.raises(ValueError, match="in the weight's format"):
        fp8_linear(fnuz, weight, scale)


def test_row_quantization_kernel_equals_torch():
    """The W8A8 path's activation quantization (one launch): torch's bytes and scales exactly."""
    from hal.cuda.fp8 import quantize_rows as torch_quantize_rows

    x = (torch.randn(5, 200) * torch.rand(5, 1) * 30).bfloat16()
    x[2] = 0.0
    q, scale = quantize_rows(x)
    want_q, want_scale = torch_quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)


def test_silu_mul_quantization_is_silu_and_mul_then_the_row_quantization():
    """The FP8 down projection's activation past the decode rows in one launch: the bytes and scales of
    `silu_and_mul` then `quantize_rows`, a zero row and large values included."""
    x = (torch.randn(6, 2 * 200) * torch.rand(6, 1) * 8).bfloat16()
    x[3] = 0.0
    q, scale = silu_mul_quantize_rows(x)
    want_q, want_scale = quantize_rows(silu_and_mul(x))
    assert q.shape == (6, 200) and scale.shape == (6, 1)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)


BOUNDARIES = {"sandwich": (True, False), "sum_first": (True, True), "pre-norm": (False, False)}


@pytest.mark.parametrize("boundary", list(BOUNDARIES))
def test_boundary_quantization_is_norm_add_norm_then_the_row_quantization(boundary):
    """q|k|v's and gate|up's input past the decode rows in one launch (lever 132): the norm boundary's h
    as `norm_add_norm` stores it, and its normalised rows as `quantize_rows` of norm_add_norm's y, bytes
    and scales, a row of zeros and a width that is not a power of two included."""
    has_post, sum_first = BOUNDARIES[boundary]
    x, residual = (torch.randn(7, 200) * torch.rand(7, 1) * 6).bfloat16(), torch.randn(7, 200).bfloat16()
    x[4], residual[4] = 0.0, 0.0
    post, weight = (torch.rand(200) + 0.5).bfloat16() if has_post else None, (torch.rand(200) + 0.5).bfloat16()
    rows, h = norm_add_norm_quantize(x, residual, post, weight, 1e-6, sum_first)
    want_y, want_h = norm_add_norm(x, residual, post, weight, 1e-6, sum_first)
    want_q, want_scale = quantize_rows(want_y)
    assert rows.data.shape == (7, 200) and rows.scale.shape == (7, 1) and rows.dtype == torch.bfloat16
    assert torch.equal(h, want_h)
    assert torch.equal(rows.data.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(rows.scale, want_scale)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_fp8_boundary_quantizes_only_for_the_scaled_mm_rows(arch):
    """`norm_add_norm_fp8`: on sm_90, past the decode GEMV's 8 rows, the boundary hands the FP8 product its
    rows quantized, and `fp8_linear` of them is `fp8_linear` of norm_add_norm's y bit for bit; at 8 rows
    (the W8A8 slices quantize per slice) and on gfx942 (no `_scaled_mm`: W8A16) there is no such op or it
    declines."""
    from hal.cuda.fp8 import norm_add_norm_fp8_op

    configs = configs_for(arch)
    op, linear = norm_add_norm_fp8_op(arch, configs), fp8_linear_op(arch, configs, True)
    if arch != "sm_90":
        assert op is None
        return
    weight, scale = quantize(torch.randn(48, 64) * 0.05, torch.float8_e4m3fn)
    norm_weight = (torch.rand(64) + 0.5).bfloat16()
    for rows in (8, 40):
        x, residual = torch.randn(1, rows, 64).bfloat16(), torch.randn(1, rows, 64).bfloat16()
        out = op(x, residual, norm_weight, norm_weight, 1e-6)
        if rows <= 8:
            assert out is None
            continue
        quantized, h = out
        y, want_h = norm_add_norm(x, residual, norm_weight, norm_weight, 1e-6)
        assert quantized.shape == (1, rows, 64) and torch.equal(h, want_h)
        assert torch.equal(linear(quantized.flat(), weight, scale), linear(y.reshape(rows, 64), weight, scale))


def test_conformance_checks_the_boundary_quantization_of_the_sm_90_ops():
    """The R2 check of `norm_add_norm_fp8` (hal/conformance/quant.py) passes on the sm_90 ops (interpreted),
    and fails on a boundary whose rows are not what `fp8_linear` would make of norm_add_norm's y."""
    from hal.conformance.quant import _check_norm_add_norm_fp8
    from hal.cuda.fp8 import norm_add_norm_fp8_op

    configs = configs_for("sm_90")
    ops = {"norm_add_norm": norm_add_norm, "fp8_linear": fp8_linear_op("sm_90", configs, True),
           "norm_add_norm_fp8": norm_add_norm_fp8_op("sm_90", configs)}

    class Sm90OpsOnCpu(CpuHal):
        def op(self, name):
            return ops.get(name)

    assert _check_norm_add_norm_fp8(Sm90OpsOnCpu(), torch.float8_e4m3fn)
    good = ops["norm_add_norm_fp8"]

    def off_by_a_scale(*args, **kwargs):
        rows, h = good(*args, **kwargs)
        return rows._replace(scale=rows.scale * 2), h
    ops["norm_add_norm_fp8"] = off_by_a_scale
    with pytest.raises(AssertionError, match="not fp8_linear of norm_add_norm's y"):
        _check_norm_add_norm_fp8(Sm90OpsOnCpu(), torch.float8_e4m3fn)


@pytest.mark.parametrize("arch", ["sm_90", "gfx942"])
def test_fp8_swiglu_past_the_decode_rows_quantizes_in_one_launch(arch, monkeypatch):
    """`silu_mul_fp8_linear` at 40 rows: where the product is `_scaled_mm`'s (sm_90) SwiGLU runs in the
    quantization launch, with no `silu_and_mul`, and the result is the unfused path's bit for bit; on gfx942
    (the W8A16 kernel) SwiGLU stays its own launch."""
    configs = configs_for(arch)
    calls = []

    def counted(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped
    monkeypatch.setattr(fp8_row_kernels, "silu_mul_quantize_rows", counted("fused", silu_mul_quantize_rows))
    linear = fp8_linear_op(arch, configs, True)
    silu = counted("silu_and_mul", silu_and_mul)
    op = silu_mul_fp8_linear_op(arch, configs, linear, silu)
    weight, scale = quantize(torch.randn(48, 64) * 0.05, torch.float8_e4m3fn)
    gate_up, residual = (torch.randn(40, 128) * 2).bfloat16(), torch.randn(40, 48).bfloat16()
    got = op(gate_up, weight, scale, residual)
    assert calls == (["fused"] if arch == "sm_90" else ["silu_and_mul"])
    assert torch.equal(got, residual + linear(silu_and_mul(gate_up), weight, scale))


def test_engine_over_an_fp8_cache_through_triton_with_graphs():
    """Packed and chunked prefill, then decode through graphs, every KV write and attention in the
    Triton kernels over an e4m3fn cache: the CPU reference engine's tokens."""
    case = golden_case("ouro-tiny-gqa-bf16")
    model = zoo.from_pretrained(case.path, dtype="float32")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    # fewer interpreted programs: 32 tokens per KV-write program, no context split (tested above)
    triton = TritonOnCpu(configs={**configs_for("default"), "kv_write": FAST_WRITE}, num_compute_units=1)
    tokens = {}
    for label, h in (("triton", triton), ("cpu", CpuHal())):
        engine = LLMEngine(model, h, EngineConfig(kv_dtype="fp8", block_size=4, max_num_batched_tokens=9,
                                                  graphs=True, max_num_seqs=2))
        for i in range(2):
            engine.add_request(str(i), case.prompt(i), params)
        tokens[label] = {o.request_id: o.token_ids for o in engine.run_until_done()}
        if label == "triton":
            assert engine.runner.backend.kv_layout is not None and engine.runner.graphs.captured
    assert tokens["triton"] == tokens["cpu"]



@pytest.mark.parametrize("candidate", ["W8A8_TILE_CANDIDATE", "W8A8_SPLIT_CANDIDATE"])
def test_quantized_rows_up_to_128_take_the_w8a8_tile_on_sm_90(monkeypatch, candidate):
    """Lever 137: with an `fp8_linear_w8a8` entry (its sm_90 candidates, whole or with K split: the sm_90
    table's since lever 139) W8A8 products of at most `W8A8_TILE_MAX_ROWS`
    quantized rows run the tile kernel's W8A8 form, more rows `_scaled_mm`; rows quantized by the op itself
    (o's input) and by the kernel before (`QuantizedRows`) alike; the two forms agree to bf16 rounding; a
    table without the entry keeps `_scaled_mm` for every size."""
    import hal.cuda.fp8 as fp8_module
    from hal.common.quantized_rows import QuantizedRows
    from hal.kernels import fp8_linear as fp8_linear_kernels

    calls = []
    tile, scaled = fp8_linear_kernels.fp8_linear, fp8_module.scaled_mm_rows
    monkeypatch.setattr(fp8_linear_kernels, "fp8_linear",
                        lambda *a, **k: calls.append("tile") or tile(*a, **k))
    monkeypatch.setattr(fp8_module, "scaled_mm_rows",
                        lambda *a, **k: calls.append("scaled_mm") or scaled(*a, **k))
    import hal.kernels.configs as config_module

    # K = 3,200: 25 steps of 128, so the split candidate splits in two on the interpreter's 4 units
    weight, scale = quantize(torch.randn(48, 3200) * 0.05, torch.float8_e4m3fn)
    table = configs_for("sm_90")
    assert table["fp8_linear_w8a8"] == config_module.W8A8_SPLIT_CANDIDATE
    without = fp8_linear_op("sm_90", {k: v for k, v in table.items() if k != "fp8_linear_w8a8"}, True)
    linear = fp8_linear_op("sm_90", {**table, "fp8_linear_w8a8": getattr(config_module, candidate)}, True)
    for num_rows, form in ((40, "tile"), (fp8_module.W8A8_TILE_MAX_ROWS, "tile"),
                           (fp8_module.W8A8_TILE_MAX_ROWS + 1, "scaled_mm")):
        x = torch.randn(num_rows, 3200).bfloat16()
        rows = QuantizedRows(*quantize_rows(x, torch.float8_e4m3fn), x.dtype)
        calls.clear()
        got, from_x = linear(rows, weight, scale), linear(x, weight, scale)
        assert calls == [form, form] and torch.equal(got, from_x)
        calls.clear()
        want = without(rows, weight, scale)
        assert calls == ["scaled_mm"]
        assert (got.float() - want.float()).abs().max() <= 2e-2 * want.float().abs().max()


def test_the_deep_w8a8_entry_takes_products_whose_tiles_fit_two_an_sm():
    """Lever 140: `fp8_linear_w8a8_deep` where a product's 64 x 64 tiles number at most two per SM, else the
    table's entry; at Ouro-1.4B's shapes on 132 SMs that is the probe's winners (58th session): every product
    of 64 rows, and of 128 rows all but gate|up (352 tiles)."""
    from hal.kernels.configs import W8A8_DEEP_CANDIDATE as deep, W8A8_SPLIT_CANDIDATE as entry
    from hal.kernels.fp8_linear import w8a8_config

    for rows in (64, 128):
        for name, cols in (("q|k|v", 6144), ("o", 2048), ("gate|up", 11264), ("down", 2048)):
            want = entry if (rows, name) == (128, "gate|up") else deep
            assert w8a8_config(rows, cols, entry, deep, 132) == want, (rows, name)
    assert w8a8_config(16, 11264, entry, None, 132) == entry


def test_the_w8a8_op_routes_by_grid_with_a_deep_entry(monkeypatch):
    """Lever 140: with both entries the op hands each product the config `w8a8_config` picks for its grid
    on the device's compute units (the interpreter's stand-in), and the two configs agree on the product."""
    import hal.cuda.fp8 as fp8_module
    from hal.common.quantized_rows import QuantizedRows
    from hal.kernels import fp8_linear as fp8_linear_kernels
    from hal.kernels.backend import DEFAULT_CPU_COMPUTE_UNITS
    from hal.kernels.configs import W8A8_DEEP_CANDIDATE, W8A8_SPLIT_CANDIDATE

    used = []
    tile = fp8_linear_kernels.fp8_linear
    monkeypatch.setattr(fp8_linear_kernels, "fp8_linear", lambda *a: used.append(a[4]) or tile(*a))
    table = {**configs_for("sm_90"), "fp8_linear_w8a8_deep": W8A8_DEEP_CANDIDATE}
    linear = fp8_linear_op("sm_90", table, True)
    narrow = 64 * 2 * DEFAULT_CPU_COMPUTE_UNITS            # columns: two tiles a unit at 64 rows
    weight, scale = quantize(torch.randn(narrow + 64, 640) * 0.05, torch.float8_e4m3fn)
    x = torch.randn(64, 640).bfloat16()
    rows = QuantizedRows(*quantize_rows(x, torch.float8_e4m3fn), x.dtype)
    got_deep = linear(rows, weight[:narrow], scale[:narrow])
    got_wide = linear(rows, weight, scale)
    assert used == [W8A8_DEEP_CANDIDATE, W8A8_SPLIT_CANDIDATE]
    assert fp8_module.W8A8_TILE_MAX_ROWS >= 64
    assert (got_deep.float() - got_wide[:, :narrow].float()).abs().max() <= 1e-2 * got_wide.float().abs().max()


@pytest.mark.parametrize("form", ["w8a8", "w8a16-bf16", "w8a16-fp32"])
def test_split_k_tiles_sum_their_shares_of_k_in_split_order(form):
    """Lever 139: with `split_k` (fixed, or 0: enough programs for every compute unit) each program streams a
    share of K and the last split of a tile sums the partials in split order before the epilogue: the
    dequantized product to the form's rounding, the same bits run after run, the arrival counters back at
    zero; ragged M, N and K (a last split of fewer K steps, a masked last step). K = 3,200 in steps of 64
    is 50 steps: fixed at 3, 17 + 17 + 16; auto, on 4 units, two of 25 (each at least `MIN_K_PER_SPLIT`,
    24 steps)."""
    from hal.common.quantized_rows import QuantizedRows
    from hal.kernels.fp8_linear import split_plan

    weight, scale = quantize(torch.randn(72, 3200) * 0.05, torch.float8_e4m3fn)
    x = (torch.randn(40, 3200) * torch.rand(40, 1) * 4)
    if form == "w8a8":
        x = QuantizedRows(*quantize_rows(x.bfloat16(), torch.float8_e4m3fn), torch.bfloat16)
        ref = (x.data.double() * x.scale.double()) @ (weight.double() * scale.double()[:, None]).T
    else:
        x = x.bfloat16() if form == "w8a16-bf16" else x
        ref = x.double() @ (weight.double() * scale.double()[:, None]).T
    whole = fp8_linear(x, weight, scale, None, KernelConfig(64, 32, 4, 2, block_k=64))
    for split_k, splits in ((3, 3), (0, 2)):
        config = KernelConfig(64, 32, 4, 2, block_k=64, split_k=split_k)
        assert split_plan(40, 72, 3200, config, 4).split_k == splits
        got = fp8_linear(x, weight, scale, None, config)
        assert torch.equal(got, fp8_linear(x, weight, scale, None, config))
        assert not gemv_ops.split_counters(torch.device("cpu")).any()
        err = (got.double() - ref).abs()
        if form == "w8a16-fp32":
            assert err.max().item() <= 1e-5
        else:
            assert (err <= 2 ** -7 * ref.abs() + 1e-3).all()
            assert (got.float() - whole.float()).abs().max() <= 2e-2 * whole.float().abs().max()


def test_split_plan_fills_the_device_at_ouro_s_prompt_products():
    """The plan at 128 rows of Ouro-1.4B's products in 64 x 64 tiles, 128 of K a step, on 132 SMs: only down
    splits, in two (its 64 tiles under 132 SMs, 22 steps of K each; four would leave 11, under
    `MIN_K_PER_SPLIT`); o (16 steps) and q|k|v at 64 rows (96 tiles) stay whole, as q|k|v and gate|up at 128
    rows (192 and 352 tiles); a fixed split of 16 steps by 3 is 6 + 6 + 4; one split where the counters would
    not reach."""
    from hal.kernels.fp8_linear import SplitPlan, split_plan

    auto = KernelConfig(64, 64, 4, 4, block_k=128, split_k=0)
    assert split_plan(128, 2048, 2048, auto, 132) == SplitPlan(1, 2048)
    assert split_plan(128, 2048, 5632, auto, 132) == SplitPlan(2, 22 * 128)
    assert split_plan(64, 6144, 2048, auto, 132) == SplitPlan(1, 2048)
    assert split_plan(128, 6144, 2048, auto, 132) == SplitPlan(1, 2048)
    assert split_plan(128, 11264, 2048, auto, 132) == SplitPlan(1, 2048)
    assert split_plan(128, 2048, 2048, replace(auto, split_k=3), 132) == SplitPlan(3, 768)
    assert split_plan(1 << 16, 1 << 12, 2048, KernelConfig(16, 32, 4, 4, block_k=128, split_k=4),
                      132).split_k == 1
