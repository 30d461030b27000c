"""On an NVIDIA GPU (sm_89+): FP8 KV through the Triton kernels and FP8 weights through
`torch._scaled_mm` and the Triton W8A16 kernel (run by tools/gpu_check.sh fp8 on the H200; last on
2026-12-04, docs/benchmarks.md). The CPU suite covers the same code in the Triton interpreter."""
import random

import pytest
import torch

import hal
import zoo
from hal.conformance.quant import check_fp8_linear, check_quantized_kv
from helpers import CONFIGS, golden_case, golden_names
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def gpu():
    h = hal.get("cuda")
    if h.caps.fp8_dtype is None:
        pytest.skip(f"{h.caps.arch} has no FP8")
    return h


def test_conformance_checks(gpu):
    print(check_quantized_kv(gpu), "|", check_fp8_linear(gpu))


def test_quantizing_write_stores_the_reference_bytes(gpu):
    """The Triton KV write over an FP8 cache stores, byte for byte, what the CPU reference stores
    (values and exponent-byte scales), rows of subnormal, huge and zero magnitude included: the
    writers multiply by the scale's exact inverse where the reference divides (lever 90)."""
    from hal.common.torch_attention import TorchPagedAttention
    from hal.conformance.attention_checks import _history_batch, _random_batch

    for dtype, (heads, kv_heads, dim) in ((torch.bfloat16, (16, 8, 128)), (torch.float32, (6, 3, 40))):
        backend = gpu.attention(heads, kv_heads, dim, dtype, kv_dtype=gpu.caps.fp8_dtype)
        reference = TorchPagedAttention(heads, kv_heads, dim, torch.float32, torch.device("cpu"),
                                        backend.block_size, kv_dtype=gpu.caps.fp8_dtype)
        batch = _history_batch(_random_batch(random.Random(3), backend.block_size, 1, 40))
        keys, values = (torch.randn(sum(batch.seq_lens), kv_heads, dim).to(dtype) for _ in range(2))
        keys[0::4] *= 1e-39
        keys[1::4] *= 1e37 if dtype == torch.float32 else 1e30
        values[2::4] = 0.0
        cache = torch.zeros(backend.kv_cache_shape(40), dtype=backend.kv_cache_dtype, device="cuda")
        ref_cache = torch.zeros(reference.kv_cache_shape(40), dtype=reference.kv_cache_dtype)
        backend.write_kv(keys.cuda(), values.cuda(), cache, backend.build_meta(batch), 0)
        reference.write_kv(keys.float(), values.float(), ref_cache, reference.build_meta(batch), 0)
        assert torch.equal(cache.cpu(), ref_cache), f"{dtype}: the cache bytes differ from the reference's"


def test_prompts_over_an_fp8_cache_attend_over_their_own_kv(gpu, monkeypatch):
    """Levers 135-136 on the GPU, at Ouro-1.4B's heads: prompts without context over an FP8 cache attend
    over the K/V their write hands back on the 16-bit tile, bit for bit the 16-bit kernel over a 16-bit
    cache holding those values, and within 2e-2 of the FP8 kernel reading the cache back; over a 16-bit
    cache over their own k and v, bit for bit the kernel reading the cache."""
    from hal.attention import PagedBatch

    monkeypatch.setenv("LOOPSTACK_FRESH_PREFILL", "0")          # eager prompts: not the fresh path
    lens = [1024, 300, 77]
    backend = gpu.attention(16, 16, 128, torch.bfloat16, kv_dtype=gpu.caps.fp8_dtype)
    bf16 = gpu.attention(16, 16, 128, torch.bfloat16, block_size=backend.block_size)
    page = backend.block_size
    tables, start = [], 0
    for n in lens:
        tables.append(list(range(start, start + -(-n // page))))
        start += len(tables[-1])
    batch = PagedBatch(lens, lens, [tables], backend.block_size)
    q, k, v = (torch.randn(sum(lens), 16, 128, device="cuda").bfloat16() for _ in range(3))
    meta, bf16_meta = backend.build_meta(batch), bf16.build_meta(batch)
    assert meta.own_kv and bf16_meta.own_kv
    cache = torch.zeros(backend.kv_cache_shape(start), dtype=backend.kv_cache_dtype, device="cuda")
    out = backend.attend(q, k, v, cache, meta, 0, 128 ** -0.5)
    k_held, v_held = backend.write_kv(k, v, torch.zeros_like(cache), meta, 0, dequantize=True)
    bf16_cache = torch.zeros(bf16.kv_cache_shape(start), dtype=torch.bfloat16, device="cuda")
    bf16.write_kv(k_held, v_held, bf16_cache, bf16_meta, 0)
    torch.cuda.synchronize()
    assert torch.equal(out, bf16.forward(q, bf16_cache, bf16_meta, 0, 128 ** -0.5))
    assert (out.float() - backend.forward(q, cache, meta, 0, 128 ** -0.5).float()).abs().max().item() < 2e-2
    own = bf16.attend(q, k, v, torch.zeros_like(bf16_cache), bf16_meta, 0, 128 ** -0.5)
    bf16.write_kv(k, v, bf16_cache, bf16_meta, 0)
    torch.cuda.synchronize()
    assert torch.equal(own, bf16.forward(q, bf16_cache, bf16_meta, 0, 128 ** -0.5))


def _run(model, h, prompts, params, **config):
    engine = LLMEngine(model, h, EngineConfig(**config))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out = {o.request_id: o.token_ids for o in engine.run_until_done()}
    return [out[str(i)] for i in range(len(prompts))], engine


@pytest.mark.parametrize("name", golden_names())
def test_golden_fp8_kv_graphs_equal_eager_fp32(name, gpu):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        case = golden_case(name)
        model = zoo.from_pretrained(case.path, dtype="float32", device=gpu.device())
        params = SamplingParams(max_tokens=case.meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True,
                                num_loops=case.meta.get("greedy_num_steps"), init_scale=0.0)
        prompts = [case.prompt(i) for i in range(case.num_prompts)]
        got = {g: _run(model, gpu, prompts, params, kv_dtype="fp8", graphs=g, max_num_batched_tokens=16)[0]
               for g in (False, True)}
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert got[True] == got[False]
    agree = sum(a == b for i, t in enumerate(got[True]) for a, b in zip(t, case.greedy(i)))
    print(f"{name}: fp8 KV on cuda, greedy agreement with float32 {agree}/{sum(map(len, got[True]))}")


def test_fp8_paths_at_ouro_1_4b_shape(gpu):
    """bf16 model at the real shape, 32 requests: FP8 KV and FP8 weights each give the same tokens with
    and without graphs; agreement with bf16 printed (random weights: indicative only)."""
    model = zoo.from_config(CONFIGS / "ouro-1.4b.json", dtype="bfloat16", device=gpu.device(), seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 49152) for _ in range(rng.randint(4, 200))] for _ in range(32)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    common = dict(max_num_seqs=32, max_model_len=256, max_num_batched_tokens=4096)
    base, _ = _run(model, gpu, prompts, params, **common)
    for kv, weights in (("fp8", "auto"), ("auto", "fp8")):
        runs = {}
        for graphs in (False, True):
            runs[graphs], engine = _run(model, gpu, prompts, params, kv_dtype=kv, weights_dtype=weights,
                                        graphs=graphs, **common)
            del engine
            torch.cuda.empty_cache()
        assert runs[True] == runs[False], (kv, weights)
        agree = sum(a == b for x, y in zip(runs[True], base) for a, b in zip(x, y))
        print(f"kv={kv} weights={weights}: graphs == eager; agreement with bf16 {agree}/{32 * 16}")
        if weights == "fp8":
            break                     # the model is FP8 from here on


def test_scaled_mm_and_triton_fp8_linear_agree(gpu, monkeypatch):
    from hal.cuda.fp8 import GEMM_ENV, fp8_linear_op
    from hal.common.kv_quant import quantize

    x = torch.randn(64, 2048, device=gpu.device(), dtype=torch.bfloat16)
    weight, scale = quantize(torch.randn(11264, 2048, device=gpu.device()) * 0.02, torch.float8_e4m3fn)
    ref = x.double() @ (weight.double() * scale.double()[:, None]).T
    outs = {}
    for choice in ("scaled_mm", "triton"):
        monkeypatch.setenv(GEMM_ENV, choice)
        outs[choice] = fp8_linear_op(gpu.caps.arch, gpu.kernel_configs(), True)(x, weight, scale)
    for choice, out in outs.items():
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"{choice}: relative error {rel:.2e}")
        assert rel < (3e-2 if choice == "scaled_mm" else 5e-3)


def test_swiglu_quantization_is_the_two_launches_bytes(gpu):
    """Lever 131 on the GPU: the FP8 down projection's fused SwiGLU quantization gives the bytes and scales of
    silu_and_mul then quantize_rows at Ouro-1.4B's MLP width (both compiled for this device), and the op at
    a prompt's rows the unfused path's result bit for bit."""
    from hal.common.kv_quant import quantize
    from hal.kernels.fp8_rows import quantize_rows, silu_mul_quantize_rows

    gate_up = (torch.randn(300, 2 * 5632, device=gpu.device()) * 3).bfloat16()
    q, scale = silu_mul_quantize_rows(gate_up)
    want_q, want_scale = quantize_rows(gpu.op("silu_and_mul")(gate_up))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
    weight, w_scale = quantize(torch.randn(2048, 5632, device=gpu.device()) * 0.02, torch.float8_e4m3fn)
    residual = torch.randn(300, 2048, device=gpu.device(), dtype=torch.bfloat16)
    got = gpu.op("silu_mul_fp8_linear")(gate_up, weight, w_scale, residual)
    want = residual + gpu.op("fp8_linear")(gpu.op("silu_and_mul")(gate_up), weight, w_scale)
    assert torch.equal(got, want)


@pytest.mark.parametrize("sum_first", [False, True])
def test_boundary_quantization_is_the_two_launches_bytes(gpu, sum_first):
    """Lever 132 on the GPU: the norm boundary that quantizes its rows for a prompt's FP8 q|k|v or gate|up
    gives norm_add_norm's h and the bytes and scales of quantize_rows of norm_add_norm's y at Ouro-1.4B's
    width (all compiled for this device), and the Hal's op declines the decode GEMV's 8 rows. Ouro's
    boundary bit for bit (three H100 calls); Huginn's (`sum_first`) was not, in all three: the quantizing
    kernel's layout (16 values a thread for its FP8 store, where norm_add_norm keeps 8) sums a row's
    squares in another order, so a last bit of h and y can move, and with it one FP8 step of a value."""
    from hal.kernels.fp8_rows import quantize_rows

    x, residual = ((torch.randn(300, 2048, device=gpu.device()) * 3).bfloat16() for _ in range(2))
    post, weight = ((torch.rand(2048, device=gpu.device()) + 0.5).bfloat16() for _ in range(2))
    # the boundary kernels read the norm weights before their PDL wait (a model's weights are written by no
    # kernel of the step); these were written by the launch just before: let it finish first
    torch.cuda.synchronize()
    rows, h = gpu.op("norm_add_norm_fp8")(x, residual, post, weight, 1e-6, sum_first=sum_first)
    y, want_h = gpu.op("norm_add_norm")(x, residual, post, weight, 1e-6, sum_first=sum_first)
    want_q, want_scale = quantize_rows(y)
    if not sum_first:
        assert torch.equal(h, want_h)
        assert torch.equal(rows.data.view(torch.uint8), want_q.view(torch.uint8))
        assert torch.equal(rows.scale, want_scale)
    else:
        torch.testing.assert_close(h, want_h, rtol=2**-7, atol=0)
        torch.testing.assert_close(rows.scale, want_scale, rtol=2**-7, atol=0)
        got, want = rows.data.float() * rows.scale, want_q.float() * want_scale
        torch.testing.assert_close(got, want, rtol=2**-3, atol=2**-9 * want_scale.max().item())   # one step
        print(f"sum_first: h differs in {(h != want_h).sum().item()} of {h.numel()} values, "
              f"the FP8 rows in {(rows.data.view(torch.uint8) != want_q.view(torch.uint8)).sum().item()}")
    assert gpu.op("norm_add_norm_fp8")(x[:8], residual[:8], post, weight, 1e-6) is None


@pytest.mark.parametrize("block_n,block_k,warps,rows", [(64, 512, 4, 1), (64, 1024, 4, 1), (128, 256, 4, 1),
                                                         (64, 256, 4, 1), (128, 512, 8, 1), (128, 512, 8, 8)])
def test_w8a8_slice_matches_its_reference_at_ouro_shapes(block_n, block_k, warps, rows, gpu):
    """Lever 118's W8A8 slice (x quantized per row and block_k slice, wgmma on e4m3; one row, or a
    decode batch of 8) against the float64 product of the same quantized values at Ouro-1.4B's four
    shapes, SwiGLU prologue on down."""
    from hal.common.kv_quant import quantize
    from hal.kernels import gemv
    from hal.kernels.configs import KernelConfig
    from hal.kernels.gemv_slice import num_splits, slice_gemv_launch
    from hal.kernels.launch import run_launch
    from kernel_reference import silu_and_mul_ref, w8a8_slices_ref

    dev = gpu.device()
    config = KernelConfig(16 if rows > 1 else 1, block_n, warps, 1, block_k=block_k)
    for n, k in ((6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)):
        swiglu = k == 5632
        weight, scale = quantize(torch.randn(n, k, device=dev) * 0.02, torch.float8_e4m3fn)
        x = torch.randn(rows, 2 * k if swiglu else k, device=dev, dtype=torch.bfloat16)
        a = silu_and_mul_ref(x) if swiglu else x
        splits = num_splits(k, config)
        out = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
        run_launch(slice_gemv_launch(x, weight, out, config, "cuda", prologue=gemv.SILU_AND_MUL if swiglu else gemv.NONE,
                                     workspace=torch.empty(splits * rows * n, device=dev),
                                     counters=torch.zeros(n, dtype=torch.int32, device=dev), weight_scale=scale,
                                     a8=True))
        ref = w8a8_slices_ref(a, weight, scale, block_k)
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        print(f"w8a8 {rows} x {n}x{k} bn{block_n} bk{block_k} w{warps}: rel {rel:.2e}")
        assert rel < 5e-3                  # the bf16 rounding of out (and of the SwiGLU input)


@pytest.mark.parametrize("rows", [64, 128])
def test_w8a8_tile_with_k_split_at_ouro_shapes(rows, gpu):
    """Lever 139 on the GPU: the W8A8 tile whole and with K split (PDL on, its first weight tile before the
    wait), and lever 140's deep candidate, at Ouro-1.4B's four products: within bf16 rounding of `_scaled_mm` on the same quantized rows, the
    same bits run after run and replayed in a CUDA graph, the split counters back at zero."""
    from hal.common.kv_quant import quantize
    from hal.common.quantized_rows import QuantizedRows
    from hal.cuda.fp8 import scaled_mm_rows
    from hal.kernels import gemv_ops
    from hal.kernels.configs import W8A8_DEEP_CANDIDATE, W8A8_SPLIT_CANDIDATE, W8A8_TILE_CANDIDATE
    from hal.kernels.fp8_linear import fp8_linear
    from hal.kernels.fp8_rows import quantize_rows

    device = gpu.device()
    for n, k in ((6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)):
        weight, scale = quantize(torch.randn(n, k, device=device) * k ** -0.5, torch.float8_e4m3fn)
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        quantized = QuantizedRows(*quantize_rows(x, torch.float8_e4m3fn), x.dtype)
        want = scaled_mm_rows(quantized, weight, scale).float()
        for config in (W8A8_TILE_CANDIDATE, W8A8_SPLIT_CANDIDATE, W8A8_DEEP_CANDIDATE):
            got = fp8_linear(quantized, weight, scale, None, config)
            assert torch.equal(got, fp8_linear(quantized, weight, scale, None, config)), (n, k, config)
            assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max(), (n, k, config)
            graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fp8_linear(quantized, weight, scale, None, config)       # warm-up: compile, counters
                with torch.cuda.graph(graph, stream=stream):
                    replayed = fp8_linear(quantized, weight, scale, None, config)
            torch.cuda.current_stream().wait_stream(stream)
            replayed.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, got), (n, k, config)
    assert not gemv_ops.split_counters(device).any()
