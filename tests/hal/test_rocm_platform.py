"""ROCm platform decisions on a simulated ROCm torch (no AMD GPU here): detection, arch-derived
caps, attention backends and kernel configs, visible devices, and the host-buffer (UVA) choice."""
import ctypes
import logging

import pytest
import torch

import hal
from hal.common.torch_attention import TorchPagedAttention
from hal.cuda import CudaHal
from hal.cuda import host_buffer as buffers
from hal.rocm import RocmHal
from hal.rocm.driver import hip_host_device_pointer
from hal.rocm.visible import sync_visible_devices

MI300X = "gfx942:sramecc+:xnack-"


def test_detection_reads_no_device_properties(simulate, monkeypatch):
    simulate("rocm", arch=MI300X, device_count=2)

    def touched(*args):
        raise AssertionError("is_available() read device properties (that creates a context)")

    monkeypatch.setattr(torch.cuda, "get_device_properties", touched)
    assert RocmHal.is_available() and not CudaHal.is_available()   # a HIP torch is not the CUDA Hal's
    assert hal.detect() == "rocm" and hal.platform_of("cuda") == "rocm"
    assert hal.get("rocm").device_count() == 2


def test_not_available_without_hip_or_devices(simulate, monkeypatch):
    simulate("rocm", arch=MI300X, device_count=0)
    assert not RocmHal.is_available()
    simulate("cuda")
    assert not RocmHal.is_available()


@pytest.mark.parametrize("arch,name,warp,fp8", [
    (MI300X, "gfx942", 64, torch.float8_e4m3fnuz),
    ("gfx950", "gfx950", 64, torch.float8_e4m3fn),
    ("gfx90a:sramecc+:xnack-", "gfx90a", 64, None),
    ("gfx1100", "gfx1100", 32, None),
    ("gfx1201", "gfx1201", 32, torch.float8_e4m3fn),
])
def test_caps_follow_the_gfx_arch(simulate, fake_kernels, arch, name, warp, fp8):
    simulate("rocm", arch=arch, num_units=256)
    caps = RocmHal().caps
    assert (caps.arch, caps.warp_size, caps.fp8_dtype, caps.num_compute_units) == (name, warp, fp8, 256)
    assert caps.attention_backends == ("triton", "torch") and caps.kv_block_sizes == (16,)
    assert caps.graphs and not caps.graph_needs_host_update and caps.uva
    assert torch.bfloat16 in caps.dtypes
    assert (RocmHal.device_type, RocmHal.dist_backend, RocmHal.visible_devices_env) == ("cuda", "nccl",
                                                                                        "HIP_VISIBLE_DEVICES")


@pytest.mark.parametrize("arch", [MI300X, "gfx950"])
def test_triton_backend_gets_the_arch_configs(simulate, fake_kernels, caplog, arch):
    simulate("rocm", arch=arch)
    with caplog.at_level(logging.INFO, logger="hal.cuda.hal"):
        backend = RocmHal().attention(16, 4, 128, torch.bfloat16)
    name = arch.split(":")[0]
    assert backend.name == "triton" and backend.block_size == 16 and backend.device == torch.device("cuda", 0)
    assert fake_kernels.configs_for == [name] and backend.configs == {"paged_decode": ("config-for", name)}
    assert "attention triton" in caplog.text and "auto: first of (triton, torch)" in caplog.text


def test_without_triton_auto_takes_torch_and_says_why(simulate, no_triton, caplog):
    simulate("rocm", arch=MI300X)
    rocm = RocmHal()
    with caplog.at_level(logging.INFO, logger="hal.cuda.hal"):
        backend = rocm.attention(8, 2, 64, torch.bfloat16)
    assert type(backend) is TorchPagedAttention and rocm.caps.attention_backends == ("torch",)
    assert "triton does not import" in caplog.text
    with pytest.raises(ValueError, match="'triton' was requested .* triton does not import"):
        rocm.attention(8, 2, 64, torch.bfloat16, backend="triton")


def test_shapes_the_kernels_do_not_take_go_to_torch(simulate, fake_kernels):
    simulate("rocm", arch=MI300X)
    rocm = RocmHal()
    assert rocm.attention(4, 4, 64, torch.float64).name == "torch"
    assert rocm.attention(4, 4, 512, torch.bfloat16).name == "torch"
    with pytest.raises(ValueError, match="head_dim 512"):
        rocm.attention(4, 4, 512, torch.bfloat16, backend="triton")


@pytest.mark.parametrize("name", ["flash_attn", "flash-attn", "FlashAttention", "fa2", "fa3", "FA"])
def test_flash_attention_is_refused_as_nvidia_only(simulate, fake_kernels, name):
    simulate("rocm", arch=MI300X)
    with pytest.raises(ValueError, match="NVIDIA-only"):
        RocmHal().attention(8, 8, 128, torch.bfloat16, backend=name)
    with pytest.raises(ValueError, match="NVIDIA-only"):
        RocmHal(attention_backend=name)


def test_unknown_backend_lists_the_choices(simulate, fake_kernels):
    simulate("rocm", arch=MI300X)
    with pytest.raises(ValueError, match="'xformers'; choose one of auto, triton, torch$"):
        RocmHal().attention(8, 8, 128, torch.bfloat16, backend="xformers")


def test_fused_ops_come_from_the_kernels(simulate, fake_kernels):
    simulate("rocm", arch="gfx950")
    rocm = RocmHal()
    assert rocm.op("rms_norm")() == "rms_norm" and rocm.op("silu_and_mul")() == "silu_and_mul"
    assert rocm.op("gelu") is None


@pytest.mark.parametrize("cuda,hip,expected", [
    ("0,1", None, "0,1"), (None, "2", "2"), ("0, 1", "0,1", "0,1"), (None, None, None), ("", None, ""),
])
def test_visible_devices_are_copied_across(cuda, hip, expected):
    given = {"CUDA_VISIBLE_DEVICES": cuda, "HIP_VISIBLE_DEVICES": hip}
    environ = {k: v for k, v in given.items() if v is not None}
    assert sync_visible_devices(environ) == expected
    if expected is None:
        assert environ == {}
    else:
        hip_list, cuda_list = environ["HIP_VISIBLE_DEVICES"], environ["CUDA_VISIBLE_DEVICES"]
        assert hip_list.replace(" ", "") == cuda_list.replace(" ", "")


def test_disagreeing_visible_devices_are_an_error(simulate, monkeypatch):
    simulate("rocm", arch=MI300X)
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='0' and HIP_VISIBLE_DEVICES='1' disagree"):
        RocmHal.is_available()


def test_detection_copies_the_visible_devices(simulate, monkeypatch):
    simulate("rocm", arch=MI300X)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert RocmHal.is_available()
    import os

    assert os.environ["HIP_VISIBLE_DEVICES"] == "3"


def _record_buffers(monkeypatch):
    made = []
    monkeypatch.setattr(buffers, "MappedHostBuffer", lambda shape, dtype, dev, ptr: made.append(("map", ptr)))
    monkeypatch.setattr(buffers, "StagedHostBuffer", lambda shape, dtype, dev: made.append(("staged", dev)))
    return made


@pytest.mark.parametrize("env,probe_ok,is_mapped", [
    ("0", True, False), ("1", False, True), (None, True, True), (None, False, False), ("auto", False, False),
])
def test_uva_decision(simulate, monkeypatch, env, probe_ok, is_mapped):
    simulate("rocm", arch=MI300X)
    probes = []

    def probe(make):
        probes.append(make)
        verdict = "mapped" if probe_ok else "hipHostGetDevicePointer failed"
        return buffers.UvaDecision(probe_ok, f"probe says {verdict}")

    monkeypatch.setattr(buffers, "probe_mapping", probe)
    if env is not None:
        monkeypatch.setenv(buffers.UVA_ENV, env)
    made = _record_buffers(monkeypatch)
    rocm = RocmHal()
    assert rocm.caps.uva is is_mapped
    rocm.host_buffer((4, 8), torch.int32)
    assert made[0][0] == ("map" if is_mapped else "staged")
    if is_mapped:
        assert made[0][1] == rocm.host_device_pointer                 # hipHostGetDevicePointer, not CUDA's
    assert len(probes) == (1 if env in (None, "auto") else 0)          # an override skips the probe
    if env is None and not probe_ok:
        assert "failed" in rocm.uva().reason


def test_bad_uva_override_names_the_values(simulate, monkeypatch):
    simulate("rocm", arch=MI300X)
    monkeypatch.setenv(buffers.UVA_ENV, "maybe")
    with pytest.raises(ValueError, match="use 1 .* 0 .* or auto"):
        RocmHal().uva()


class FakeHip:
    """libamdhip64 stand-in: writes `address` through the out-pointer and returns `error`."""

    def __init__(self, address: int, error: int = 0) -> None:
        self.address, self.error, self.calls = address, error, []

    def hipHostGetDevicePointer(self, out, host, flags):
        self.calls.append((host.value, flags.value))
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = self.address
        return self.error


def test_hip_device_pointer_through_ctypes():
    lib = FakeHip(0x7F00_0000_1000)
    assert hip_host_device_pointer(0x5000, lib=lib) == 0x7F00_0000_1000 and lib.calls == [(0x5000, 0)]
    with pytest.raises(OSError, match=r"hipHostGetDevicePointer\(0x5000\) failed with error 1"):
        hip_host_device_pointer(0x5000, lib=FakeHip(0x1000, error=1))
    with pytest.raises(OSError, match="null device address"):
        hip_host_device_pointer(0x5000, lib=FakeHip(0))
