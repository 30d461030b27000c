"""The ROCm Hal on a real AMD GPU (skipped elsewhere; never run by us: we have no AMD GPU).
The vendor-neutral checks run on this Hal through tests/hal/test_conformance.py."""
import os
import subprocess
import sys

import pytest
import torch

import hal
from hal.rocm import fp8_dtype_for, is_wave64_arch
from helpers import ROOT

pytestmark = pytest.mark.rocm


def test_caps_and_decisions_on_the_device():
    rocm = hal.get("rocm")
    caps = rocm.caps
    assert caps.arch.startswith("gfx") and caps.arch in torch.cuda.get_device_properties(0).gcnArchName
    assert caps.warp_size == (64 if is_wave64_arch(caps.arch) else 32)
    assert caps.fp8_dtype == fp8_dtype_for(caps.arch) and caps.graphs
    assert os.environ.get("HIP_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")
    print(f"rocm: {caps}; host buffers: {rocm.uva().reason}")


def test_host_buffer_reaches_the_device():
    rocm = hal.get("rocm")
    buf = rocm.host_buffer((16, 4), torch.int32)
    values = torch.randint(-1 << 30, 1 << 30, (16, 4), dtype=torch.int32)
    buf.host.copy_(values)
    buf.mark_dirty()
    assert torch.equal((buf.device_view() * 1).cpu(), values)


def test_conformance_cli_reports_a_level():
    proc = subprocess.run([sys.executable, "-m", "hal.conformance", "hal=rocm"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    print(proc.stdout)
    assert "acceptance level:" in proc.stdout and "hip=" in proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
