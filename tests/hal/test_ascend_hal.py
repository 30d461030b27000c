"""The Ascend Hal's identity, detection rule, backend choice, and the conformance suite on its CPU
simulation (strict: the 910B's shape limits; any-shape: every shape through the fused path)."""
import logging
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

import hal
from hal.ascend import detect
from hal.ascend.hal import AscendHal
from hal.ascend.sim.hal import SimAscendHal
from hal.conformance import CHECKS
from runtime.conformance import check_golden_greedy


def test_identity_and_caps():
    assert (AscendHal.name, AscendHal.device_type, AscendHal.dist_backend, AscendHal.visible_devices_env) == \
        ("ascend", "npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES")
    caps = hal.get("ascend-sim").caps
    assert caps.graphs and caps.graph_needs_host_update and not caps.uva
    assert caps.kv_block_sizes == (128,) and caps.head_dims == (128,) and caps.fp8_dtype is None
    assert hal.get("ascend-sim", sim_any_shape=True).caps.head_dims is None


@pytest.fixture
def no_sim_env(monkeypatch):
    monkeypatch.delenv(detect.SIM_ENV, raising=False)
    monkeypatch.delenv(detect.VISIBLE_DEVICES_ENV, raising=False)


@pytest.mark.parametrize("installed, davinci, npu_smi, visible, expected", [
    (False, True, True, None, False),            # no torch_npu: no Hal, whatever the driver shows
    (True, False, False, None, False),           # torch_npu but no device node and no npu-smi
    (True, True, False, None, True),             # /dev/davinci0
    (True, False, True, "0,1", True),            # npu-smi on PATH
    (True, True, True, "", False),               # ASCEND_RT_VISIBLE_DEVICES set to nothing
])
def test_detection_rule(monkeypatch, no_sim_env, installed, davinci, npu_smi, visible, expected):
    monkeypatch.setattr(detect.importlib.util, "find_spec", lambda name: object() if installed else None)
    monkeypatch.setattr(detect.glob, "glob", lambda pattern: ["/dev/davinci0"] if davinci else [])
    monkeypatch.setattr(detect.shutil, "which", lambda name: "/usr/bin/npu-smi" if npu_smi else None)
    if visible is not None:
        monkeypatch.setenv(detect.VISIBLE_DEVICES_ENV, visible)
    assert AscendHal.is_available() is expected


def test_detection_and_simulation_never_import_torch_npu(monkeypatch, no_sim_env):
    sys.modules.pop("torch_npu", None)
    AscendHal.is_available()
    h = hal.get("ascend-sim")
    h.attention(8, 2, 128, torch.bfloat16)
    assert "torch_npu" not in sys.modules
    if not detect.npu_present():
        with pytest.raises(RuntimeError, match="not available on this machine"):
            hal.get("ascend")
    monkeypatch.setenv(detect.SIM_ENV, "1")
    assert hal.get_class("ascend").is_available() and isinstance(hal.get("ascend"), SimAscendHal)
    assert hal.get("ascend-sim").name == "ascend-sim"
    with pytest.raises(TypeError):
        AscendHal(sim_any_shape=True)          # a simulation option: the real Hal does not take it


def test_backend_choice_is_logged_and_explicit_requests_are_strict(caplog):
    h = hal.get("ascend-sim")
    with caplog.at_level(logging.INFO, logger="hal.ascend.hal"):
        fused = h.attention(16, 2, 128, torch.bfloat16)
        h.attention(16, 2, 128, torch.bfloat16)
        small = h.attention(4, 2, 64, torch.bfloat16)
        fp32 = h.attention(4, 2, 128, torch.float32)
    assert fused.name == "fia" and fused.caps.graphs
    assert small.name == "torch" and "head dim 64" in small.caps.reason and not small.caps.graphs
    assert fp32.name == "torch" and "float32" in fp32.caps.reason
    assert len([r for r in caplog.records if "fia" in r.getMessage()]) == 1      # logged once per shape
    assert h.attention(16, 2, 128, torch.bfloat16, backend="fia_pa").name == "fia_pa"
    with pytest.raises(ValueError, match="cannot take .*head dim 64"):
        h.attention(4, 2, 64, torch.bfloat16, backend="fia")
    with pytest.raises(ValueError, match="unknown Ascend attention backend"):
        h.attention(4, 2, 128, torch.bfloat16, backend="flash")
    any_shape = hal.get("ascend-sim", sim_any_shape=True)
    assert any_shape.attention(4, 2, 64, torch.float32).name == "fia"
    # pages of 16: the simulation's lifted limit only; the 910B's fused op takes multiples of 128
    assert any_shape.attention(4, 2, 64, torch.float32, block_size=16).name == "fia"
    with pytest.raises(ValueError, match="block size 16 .*multiples of 128"):
        h.attention(16, 2, 128, torch.bfloat16, block_size=16, backend="fia")
    assert h.op("rms_norm") and h.op("rotary") and h.op("silu_and_mul") and h.op("gelu") is None


ALL = {**CHECKS, "golden_greedy": check_golden_greedy}


@pytest.mark.parametrize("check", sorted(ALL))
def test_conformance_strict_simulation(check):
    ALL[check](hal.get("ascend-sim"))


@pytest.mark.parametrize("check", ["paged_attention", "kv_round_trip", "graph_replay"])
def test_conformance_any_shape_simulation(check):
    """Every SHAPES entry (head dims 16..128, float32 and bf16, GQA) through the fused TND path."""
    h = hal.get("ascend-sim", sim_any_shape=True)
    CHECKS[check](h)
    if check == "paged_attention":
        assert h.ops.counts["fused_infer_attention"] >= 20


def test_conformance_cli_prints_versions(monkeypatch):
    """`hal=ascend-sim`, and `hal=ascend` with the env alias, run the simulation."""
    for name, extra in (("ascend-sim", {}), ("ascend", {detect.SIM_ENV: "1"})):
        env = {**__import__("os").environ, **extra}
        command = [sys.executable, "-m", "hal.conformance", f"hal={name}", "only=host_buffer,graph_replay"]
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "arch=Ascend910B-sim" in proc.stdout and "versions: torch_npu=not used" in proc.stdout
        assert "2/2 passed" in proc.stdout
