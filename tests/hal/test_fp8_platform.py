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
    y = linear(torch.randn(4, 64).bfloat16(), weight, scale)              # torch._scaled_mm (W8A8)
    assert isinstance(y, torch.Tensor) and y.shape == (4, 32) and y.dtype == torch.bfloat16
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
    assert mi300.op("fp8_linear")(torch.randn(4, 64).bfloat16(), weight, scale) == "triton fp8_linear"
    monkeypatch.setenv(GEMM_ENV, "scaled_mm")
    with pytest.raises(ValueError, match="needs an NVIDIA GPU of sm_89"):
        RocmHal().op("fp8_linear")
