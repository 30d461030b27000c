"""CUDA platform decisions on a simulated CUDA torch (the real device runs in test_cuda_device.py):
detection, capability-derived caps, attention choice, fused ops, host-buffer plumbing."""
import logging
from types import SimpleNamespace

import pytest
import torch

import hal
from hal.common.torch_attention import TorchPagedAttention
from hal.cuda import CudaHal, driver
from hal.cuda import host_buffer as buffers
from hal.rocm import RocmHal


def test_detection_reads_no_device_properties(simulate, monkeypatch):
    simulate("cuda", capability=(9, 0))

    def touched(*args):
        raise AssertionError("is_available() read device properties (that creates a context)")

    monkeypatch.setattr(torch.cuda, "get_device_properties", touched)
    assert CudaHal.is_available() and not RocmHal.is_available()
    assert hal.detect() == "cuda" and hal.platform_of("cuda") == "cuda"


def test_not_available_on_hip_cpu_or_without_devices(simulate, monkeypatch):
    simulate("rocm")
    assert not CudaHal.is_available()                      # a HIP torch says cuda.is_available() too
    simulate("cuda", device_count=0)
    assert not CudaHal.is_available()
    simulate("cuda")
    monkeypatch.setattr(torch.version, "cuda", None)       # a CPU build of torch
    assert not CudaHal.is_available()


@pytest.mark.parametrize("capability,arch,fp8,has_bf16", [
    ((9, 0), "sm_90", torch.float8_e4m3fn, True),
    ((8, 9), "sm_89", torch.float8_e4m3fn, True),
    ((8, 0), "sm_80", None, True),
    ((7, 5), "sm_75", None, False),
    ((10, 0), "sm_100", torch.float8_e4m3fn, True),
])
def test_caps_follow_the_compute_capability(simulate, fake_kernels, capability, arch, fp8, has_bf16):
    simulate("cuda", capability=capability, num_units=132)
    caps = CudaHal().caps
    assert (caps.arch, caps.warp_size, caps.fp8_dtype, caps.num_compute_units) == (arch, 32, fp8, 132)
    assert (torch.bfloat16 in caps.dtypes) is has_bf16
    assert caps.attention_backends == ("triton", "torch") and caps.kv_block_sizes == (16,)
    assert caps.graphs and not caps.graph_needs_host_update and caps.uva
    assert (CudaHal.device_type, CudaHal.dist_backend, CudaHal.visible_devices_env) == ("cuda", "nccl",
                                                                                        "CUDA_VISIBLE_DEVICES")


@pytest.mark.parametrize("capability,arch", [((9, 0), "sm_90"), ((8, 0), "sm_80")])
def test_triton_is_chosen_with_the_arch_configs(simulate, fake_kernels, caplog, capability, arch):
    simulate("cuda", capability=capability)
    with caplog.at_level(logging.INFO, logger="hal.cuda.hal"):
        backend = CudaHal(device_index=0).attention(32, 8, 128, torch.bfloat16, block_size=16)
    assert backend.name == "triton" and backend.configs == {"paged_decode": ("config-for", arch)}
    assert fake_kernels.configs_for == [arch] and "attention triton" in caplog.text
    # prefill without context: torch's varlen flash, with cuDNN's kernel for long prompts on Hopper
    assert backend.fresh_attention == ("cudnn" if capability >= (9, 0) else "flash")


def test_fresh_prefill_is_flash_from_ampere_and_can_be_turned_off(simulate, fake_kernels, monkeypatch):
    simulate("cuda", capability=(7, 5))
    assert CudaHal().fresh_prefill() == "sdpa"
    simulate("cuda", capability=(9, 0))
    monkeypatch.setenv("LOOPSTACK_FRESH_PREFILL", "flash")
    assert CudaHal().fresh_prefill() == "flash"
    monkeypatch.setenv("LOOPSTACK_FRESH_PREFILL", "0")
    assert CudaHal().attention(8, 8, 64, torch.bfloat16).fresh_attention is None
    monkeypatch.setenv("LOOPSTACK_FRESH_PREFILL", "cudnn")
    with pytest.raises(ValueError, match="use 0 .*, 1 .* or flash"):
        CudaHal().fresh_prefill()


def test_without_triton_torch_serves_and_explicit_triton_raises(simulate, no_triton, caplog):
    simulate("cuda")
    cuda = CudaHal()
    with caplog.at_level(logging.INFO, logger="hal.cuda.hal"):
        backend = cuda.attention(8, 8, 64, torch.float16)
    assert type(backend) is TorchPagedAttention and "skipped triton: triton does not import" in caplog.text
    assert cuda.caps.attention_backends == ("torch",) and cuda.op("rms_norm") is None
    with pytest.raises(ValueError, match="'triton' was requested on hal cuda but cannot serve"):
        CudaHal(attention_backend="triton").attention(8, 8, 64, torch.float16)


def test_explicit_torch_and_unknown_backends(simulate, fake_kernels):
    simulate("cuda")
    cuda = CudaHal()
    assert type(cuda.attention(8, 2, 40, torch.float32, backend="torch")) is TorchPagedAttention
    assert fake_kernels.configs_for == []                      # configs only for the Triton backend
    for name in ("flash_attn", "flashinfer", "sdpa"):
        with pytest.raises(ValueError, match=f"no attention backend '{name}'; choose one of auto, triton"):
            cuda.attention(8, 2, 40, torch.float32, backend=name)
    with pytest.raises(ValueError, match="no attention backend 'trition'"):
        CudaHal(attention_backend="trition")                      # a typo fails at construction


def test_fused_ops(simulate, fake_kernels):
    simulate("cuda")
    cuda = CudaHal()
    names = ["rms_norm", "norm_add_norm", "rotary", "silu_and_mul"]
    assert [cuda.op(n)() for n in names] == names
    assert cuda.op("layer_norm") is None


def test_host_buffers_map_with_cuda_pointers_unless_overridden(simulate, monkeypatch):
    simulate("cuda")
    made = []
    monkeypatch.setattr(buffers, "MappedHostBuffer", lambda shape, dtype, dev, pointer: made.append(pointer))
    monkeypatch.setattr(buffers, "StagedHostBuffer", lambda shape, dtype, device: made.append("staged"))
    cuda = CudaHal()
    cuda.host_buffer((8,), torch.int32)
    assert made == [cuda.host_device_pointer] and cuda.uva().reason == "simulated probe"
    monkeypatch.setenv(buffers.UVA_ENV, "0")
    forced = CudaHal()
    forced.host_buffer((8,), torch.int32)
    assert made[-1] == "staged" and not forced.caps.uva and "staged copies forced" in forced.uva().reason


def test_device_pointer_via_cuda_python_or_ctypes(monkeypatch):
    class Runtime:
        def __init__(self, err):
            self.err = err

        def cudaHostGetDevicePointer(self, host, flags):
            return SimpleNamespace(value=self.err), host + 0x100

    monkeypatch.setattr(driver, "_runtime", lambda: Runtime(0))
    assert driver.cuda_host_device_pointer(0x4000) == 0x4100
    monkeypatch.setattr(driver, "_runtime", lambda: Runtime(1))
    with pytest.raises(OSError, match="cudaHostGetDevicePointer"):
        driver.cuda_host_device_pointer(0x4000)

    class Cudart:                                              # the ctypes fallback, on torch's libcudart
        def cudaHostGetDevicePointer(self, out, host, flags):
            import ctypes

            ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = host.value
            return 0

    monkeypatch.setattr(driver, "_runtime", lambda: None)
    monkeypatch.setattr(driver, "_libcudart", lambda: Cudart())
    assert driver.cuda_host_device_pointer(0x8000) == 0x8000


def test_loaded_library_finds_what_this_process_mapped():
    path = driver.loaded_library("libtorch")
    assert path is not None and "libtorch" in path
    assert driver.loaded_library("libdoes-not-exist") is None
