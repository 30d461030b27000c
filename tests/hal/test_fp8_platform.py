"""FP8 decisions of the CUDA and ROCm Hals on simulated GPUs (no device): which 8-bit KV formats the
attention reads, which backend takes them, and which FP8 GEMM `op("fp8_linear")` runs."""
import pytest
import torch

from hal.common.torch_attention import TorchPagedAttention
from hal.cuda import CudaHal
from hal.cuda.fp8 import GEMM_ENV
from hal.common.kv_quant import quantize
from hal.rocm import RocmHal

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz


def test_nvidia_fp8_kv_and_gemm_paths(simulate, fake_kernels, monkeypatch):
    monkeypatch.delenv(GEMM_ENV, raising=False)
    simulate("cuda", capability=(9, 0))
    cuda = CudaHal()
    assert cuda.caps.kv_quant_dtypes == (FN,) and cuda.caps.fp8_dtype == FN
    backend = cuda.attention(8, 2, 128, torch.bfloat16, block_size=16, kv_dtype=FN)
    assert backend.name == "triton" and backend.kv_dtype == FN and backend.kv_cache_dtype == torch.uint8
    # int8 KV: the Triton kernels take FP8 only, so auto falls back to torch; asking for triton raises
    assert type(cuda.attention(8, 2, 128, torch.bfloat16, kv_dtype=torch.int8)) is TorchPagedAttention
    with pytest.raises(ValueError, match="quantize KV to FP8 only"):
        cuda.attention(8, 2, 128, torch.bfloat16, backend="triton", kv_dtype=torch.int8)
    linear = cuda.op("fp8_linear")
    weight, scale = quantize(torch.randn(32, 64), FN)
    assert linear(torch.randn(4, 64).bfloat16(), weight, scale) == "gemv fp8_linear"    # decode rows: W8A16
    y = linear(torch.randn(16, 64).bfloat16(), weight, scale)             # torch._scaled_mm (W8A8)
    assert isinstance(y, torch.Tensor) and y.shape == (16, 32) and y.dtype == torch.bfloat16
    assert linear(torch.randn(4, 64), weight, scale) == "triton fp8_linear"     # fp32 activations: W8A16
    monkeypatch.setenv(GEMM_ENV, "triton")
    forced = CudaHal()
    assert forced.op("fp8_linear")(torch.randn(4, 64).bfloat16(), weight, scale) == "triton fp8_linear"


def test_no_fp8_before_ada_and_fnuz_on_mi300(simulate, fake_kernels, monkeypatch):
    monkeypatch.delenv(GEMM_ENV, raising=False)
    simulate("cuda", capability=(8, 0))
    ampere = CudaHal()
    assert ampere.caps.kv_quant_dtypes == () and ampere.op("fp8_linear") is None
    simulate("rocm", arch="gfx942:sramecc+:xnack-")
    mi300 = RocmHal()
    assert mi300.caps.kv_quant_dtypes == (FNUZ,) and mi300.caps.fp8_dtype == FNUZ
    assert mi300.attention(8, 2, 128, torch.bfloat16, kv_dtype=FNUZ).kv_dtype == FNUZ
    weight, scale = quantize(torch.randn(32, 64), FNUZ)
    assert mi300.op("fp8_linear")(torch.randn(4, 64).bfloat16(), weight, scale) == "gemv fp8_linear"
    assert mi300.op("fp8_linear")(torch.randn(16, 64).bfloat16(), weight, scale) == "triton fp8_linear"
    monkeypatch.setenv(GEMM_ENV, "scaled_mm")
    with pytest.raises(ValueError, match="needs an NVIDIA GPU of sm_89"):
        RocmHal().op("fp8_linear")


def test_fp8_options_measured_slower_are_named_at_start(simulate, fake_kernels, caplog):
    """Where FP8 is slower than bf16 on sm_90 (docs/fp8.md: KV at batch 1, by 0-1%; prompts no longer since lever
    135, FP8 weights no longer since levers 131-133), the Hal says so, naming the faster setting, and the
    engine logs it once at start; unmeasured archs say nothing."""
    import logging

    from helpers import golden_case

    import zoo
    from hal.cpu import CpuHal
    from runtime.config import EngineConfig
    from runtime.engine.llm_engine import LLMEngine

    simulate("cuda", capability=(9, 0))
    notes = CudaHal().speed_notes(kv_quantized=True, fp8_weights=False)
    assert len(notes) == 1 and "leave engine.kv_dtype unset" in notes[0]
    assert CudaHal().speed_notes(kv_quantized=False, fp8_weights=False) == []
    assert CudaHal().speed_notes(kv_quantized=False, fp8_weights=True) == []      # level or faster since lever 133
    simulate("rocm", arch="gfx942:sramecc+:xnack-")
    assert RocmHal().speed_notes(kv_quantized=True, fp8_weights=True) == []

    class Noted(CpuHal):
        def speed_notes(self, kv_quantized, fp8_weights):
            return [f"kv {kv_quantized} weights {fp8_weights}"]

    model = zoo.from_pretrained(golden_case("ouro-tiny").path, dtype="float32")
    with caplog.at_level(logging.WARNING, logger="runtime.engine.llm_engine"):
        LLMEngine(model, Noted(), EngineConfig(kv_dtype="fp8", num_kv_blocks=8))
    assert "kv True weights False" in caplog.text


def test_fp8_down_projections_fuse_swiglu_where_fp8_linear_has_the_gemv(simulate, fake_kernels, monkeypatch):
    """`op("silu_mul_fp8_linear")` comes with the W8A16 decode GEMV of `op("fp8_linear")` (CUDA sm_89+,
    ROCm), not where FP8 has no GEMM, a GEMM is forced, or the decode projections are switched off;
    the CPU and Ascend Hals offer none (their callers run silu_and_mul, then the FP8 linear)."""
    import hal

    monkeypatch.delenv(GEMM_ENV, raising=False)
    weight, scale = quantize(torch.randn(32, 64), FN)
    simulate("cuda", capability=(9, 0))
    fused = CudaHal().op("silu_mul_fp8_linear")
    assert fused(torch.randn(1, 128).bfloat16(), weight, scale) == "gemv silu_mul_fp8_linear"
    assert CudaHal(decode_projections=False).op("silu_mul_fp8_linear") is None
    monkeypatch.setenv(GEMM_ENV, "scaled_mm")
    assert CudaHal().op("silu_mul_fp8_linear") is None
    monkeypatch.delenv(GEMM_ENV)
    simulate("cuda", capability=(8, 0))
    assert CudaHal().op("silu_mul_fp8_linear") is None
    simulate("rocm", arch="gfx942:sramecc+:xnack-")
    assert RocmHal().op("silu_mul_fp8_linear")(torch.randn(1, 128).bfloat16(), *quantize(
        torch.randn(32, 64), FNUZ)) == "gemv silu_mul_fp8_linear"
    assert hal.get("cpu").op("silu_mul_fp8_linear") is None
    assert hal.get("ascend-sim").op("silu_mul_fp8_linear") is None


def test_fp8_boundary_quantization_comes_where_fp8_linear_quantizes(simulate, fake_kernels, monkeypatch):
    """`op("norm_add_norm_fp8")` (lever 132) where `fp8_linear` quantizes a prompt's rows for `_scaled_mm`
    (CUDA sm_89+, the GEMM not forced to Triton); it declines the decode GEMV's rows and non-bf16 ones;
    none on sm_80, ROCm (W8A16), the CPU or Ascend."""
    import hal

    monkeypatch.delenv(GEMM_ENV, raising=False)
    simulate("cuda", capability=(9, 0))
    fused = CudaHal().op("norm_add_norm_fp8")
    x, weight = torch.randn(40, 64).bfloat16(), torch.ones(64).bfloat16()
    assert fused(x, x, weight, weight, 1e-6) == "norm_add_norm_quantize"
    assert fused(x[:8], x[:8], weight, weight, 1e-6) is None
    assert fused(x.float(), x.float(), weight.float(), weight.float(), 1e-6) is None
    monkeypatch.setenv(GEMM_ENV, "triton")
    assert CudaHal().op("norm_add_norm_fp8") is None
    monkeypatch.delenv(GEMM_ENV)
    simulate("cuda", capability=(8, 0))
    assert CudaHal().op("norm_add_norm_fp8") is None
    simulate("rocm", arch="gfx942:sramecc+:xnack-")
    assert RocmHal().op("norm_add_norm_fp8") is None
    assert hal.get("cpu").op("norm_add_norm_fp8") is None
    assert hal.get("ascend-sim").op("norm_add_norm_fp8") is None
