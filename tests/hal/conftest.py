"""Simulated GPUs for the platform-decision tests: a CUDA or ROCm build of torch with fake device
properties (no device is touched), and a stand-in for `hal.kernels` that records what the Hal
passes to it."""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest
import torch

from hal.common.torch_attention import TorchPagedAttention
from hal.cuda import attention
from hal.cuda import host_buffer as buffers
from hal.cuda.fp8 import quantize_rows

ENV_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", buffers.UVA_ENV)


def clear_env(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    """Unset `names` for the test; setenv first so teardown also removes values the code sets."""
    for name in names:
        monkeypatch.setenv(name, "unset-by-test")
        monkeypatch.delenv(name)


@pytest.fixture
def simulate(monkeypatch):
    """`simulate("rocm", arch="gfx942:sramecc+:xnack-")` or `simulate("cuda", capability=(9, 0))`:
    torch looks like a ROCm or CUDA build with `device_count` devices of those properties. The
    UVA probe succeeds unless a test patches `hal.cuda.host_buffer.probe_mapping` again."""
    clear_env(monkeypatch, *ENV_VARS)

    def apply(vendor: str, arch: str = "gfx942", capability: tuple[int, int] = (9, 0), num_units: int = 132,
              device_count: int = 1) -> SimpleNamespace:
        props = rocm_props(arch, num_units) if vendor == "rocm" else cuda_props(*capability, num_units)
        monkeypatch.setattr(torch.version, "hip", "6.4.43482-0f2d60242" if vendor == "rocm" else None)
        monkeypatch.setattr(torch.version, "cuda", None if vendor == "rocm" else "12.8")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: device_count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        probe = buffers.UvaDecision(True, "simulated probe")
        monkeypatch.setattr(buffers, "probe_mapping", lambda make: probe)
        return props

    return apply


def rocm_props(arch: str, num_cus: int = 304) -> SimpleNamespace:
    return SimpleNamespace(name="AMD Instinct MI300X", gcnArchName=arch, multi_processor_count=num_cus,
                           major=9, minor=4, total_memory=192 << 30)


def cuda_props(major: int, minor: int, num_sms: int = 132) -> SimpleNamespace:
    return SimpleNamespace(name="NVIDIA H200", major=major, minor=minor, multi_processor_count=num_sms,
                           total_memory=141 << 30)


@pytest.fixture
def fake_kernels(monkeypatch):
    """Triton importable, and `hal.kernels` replaced by recording stand-ins. Returns the record:
    `configs_for` (archs asked for) and `ops` (the fake fused-op module)."""
    record = SimpleNamespace(configs_for=[])

    def configs_for(arch: str) -> dict:
        record.configs_for.append(arch)
        return {"paged_decode": ("config-for", arch)}

    class TritonPagedAttention(TorchPagedAttention):
        name = "triton"

        def __init__(self, num_heads, num_kv_heads, head_dim, dtype, device, block_size, configs=None,
                     fresh_attention=None, **kv):
            super().__init__(num_heads, num_kv_heads, head_dim, dtype, device, block_size, **kv)
            self.configs, self.fresh_attention = configs, fresh_attention

    class FakeGemv:             # the decode GEMV takes 1..8 rows of 16-bit activations
        def __init__(self, configs=None, num_compute_units=None):
            self.configs = configs

        def fp8_linear(self, x, weight, scale):
            return "gemv fp8_linear" if x.shape[0] <= 8 and x.dtype != torch.float32 else None

        def silu_mul_fp8_linear(self, x, weight, scale, residual=None):
            return "gemv silu_mul_fp8_linear" if x.shape[0] <= 8 and x.dtype != torch.float32 else None

        def takes(self, rows, k, prologue=0):
            return 0 < rows <= 8

    modules = {
        "hal.kernels": _module("hal.kernels", __path__=[]),
        "hal.kernels.configs": _module("hal.kernels.configs", configs_for=configs_for),
        "hal.kernels.backend": _module("hal.kernels.backend", TritonPagedAttention=TritonPagedAttention),
        "hal.kernels.ops": _module("hal.kernels.ops", fused_ops=lambda configs=None: {
            "rms_norm": lambda *a: "rms_norm", "norm_add_norm": lambda *a: "norm_add_norm",
            "rotary": lambda *a: "rotary", "silu_and_mul": lambda *a: "silu_and_mul"}),
        "hal.kernels.gemv_ops": _module("hal.kernels.gemv_ops", Gemv=FakeGemv),
        "hal.kernels.fp8_linear": _module("hal.kernels.fp8_linear", fp8_linear=lambda *a: "triton fp8_linear"),
        "hal.kernels.fp8_rows": _module("hal.kernels.fp8_rows",
                                        quantize_rows=lambda x, dtype, config=None: quantize_rows(x),
                                        norm_add_norm_quantize=lambda *a: "norm_add_norm_quantize"),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(attention, "triton_status", lambda: (True, "triton (simulated)"))
    record.ops = modules["hal.kernels.ops"]
    return record


def _module(name: str, **attrs: object) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setattr(attention, "triton_status", lambda: (False, "triton does not import (simulated)"))
