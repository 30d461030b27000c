"""Acceptance levels (R0..R3) from check results, the fused-op check itself, and the CLI report."""
import re
import subprocess
import sys

import pytest
import torch

import hal
from hal.conformance import CHECKS, CheckResult

ALL = [*CHECKS, "golden_greedy"]           # the engine's R3 check joins the Hal's
from hal.conformance.ops import check_fused_ops, rotary_ref
from hal.conformance.report import level_reached, level_statuses, versions
from hal.cpu import CpuHal
from helpers import ROOT


def _results(**status):
    return [CheckResult(name, status.get(name, "PASS"), "") for name in ALL]


def test_all_pass_reaches_r3():
    statuses = level_statuses(_results(), ALL)
    assert [s.status for s in statuses] == ["PASS"] * 4 and level_reached(statuses) == "R3"


@pytest.mark.parametrize("status,reached,blocked", [
    (dict(golden_greedy="SKIP"), "R2", ("R3", "UNVERIFIED")),
    (dict(host_buffer="FAIL"), "R0", ("R1", "FAIL")),
    (dict(paged_attention="FAIL", golden_greedy="SKIP"), "R1", ("R2", "FAIL")),
    (dict(detect="FAIL"), None, ("R0", "FAIL")),
])
def test_a_level_needs_its_checks_and_all_below(status, reached, blocked):
    statuses = level_statuses(_results(**status), ALL)
    assert level_reached(statuses) == reached
    level = {s.code: s for s in statuses}[blocked[0]]
    assert level.status == blocked[1] and any(name in b for b in level.blockers for name in status)


def test_checks_not_run_or_unlisted_leave_levels_unverified():
    only_r0 = [CheckResult("detect", "PASS", "")]
    assert level_reached(level_statuses(only_r0, ALL)) == "R0"
    extra = _results() + [CheckResult("vendor_specific", "FAIL", "")]
    assert level_reached(level_statuses(extra, [*ALL, "vendor_specific"])) == "R0"


def _rms_norm(x, weight, eps, residual=None):
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return y if residual is None else residual + y


def _norm_add_norm(x, residual, post_weight, weight, eps, sum_first=False):
    if post_weight is None:
        h = residual + x
    elif sum_first:
        h = _rms_norm(x + residual, post_weight, eps)
    else:
        h = _rms_norm(x, post_weight, eps, residual)
    return _rms_norm(h, weight, eps), h


def _weights_swapped(x, residual, post_weight, weight, eps, sum_first=False):
    if post_weight is None or sum_first:
        return _norm_add_norm(x, residual, post_weight, weight, eps, sum_first)
    return _norm_add_norm(x, residual, weight, post_weight, eps)


def _sums_after(x, residual, post_weight, weight, eps, sum_first=False):
    return _norm_add_norm(x, residual, post_weight, weight, eps)


def _post_norm_always(x, residual, post_weight, weight, eps, sum_first=False):
    post_weight = torch.ones_like(weight) if post_weight is None else post_weight
    return _norm_add_norm(x, residual, post_weight, weight, eps, sum_first)


# norm_add_norm wrong at one of its three boundaries each, by the name the check's message gives it
BROKEN_NORM_ADD_NORM = {"norm_add_norm h": _weights_swapped, "norm_add_norm(sum_first)": _sums_after,
                        "norm_add_norm(pre-norm)": _post_norm_always}


def _silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _rotary_in_place(q, k, positions, theta, interleaved):
    q.copy_(rotary_ref(q, positions, theta, interleaved))
    k.copy_(rotary_ref(k, positions, theta, interleaved))


class FusedCpu(CpuHal):
    """A Hal offering torch versions of the fused ops; `broken` names one to get wrong."""

    def __init__(self, broken=None):
        super().__init__()
        self.broken = broken if broken not in BROKEN_NORM_ADD_NORM else "norm_add_norm"
        self.broken_norm_add_norm = BROKEN_NORM_ADD_NORM.get(broken)

    def op(self, name):
        ops = {"rms_norm": _rms_norm, "norm_add_norm": _norm_add_norm, "rotary": _rotary_in_place,
               "silu_and_mul": _silu_and_mul}
        if name == self.broken == "rms_norm":
            return lambda x, w, eps, residual=None: _rms_norm(x, torch.ones_like(w), eps, residual)
        if name == self.broken == "norm_add_norm":
            return self.broken_norm_add_norm
        if name == self.broken == "rotary":
            return lambda q, k, pos, theta, interleaved: _rotary_in_place(q, k, pos, theta, not interleaved)
        return ops.get(name)


def test_fused_op_check_passes_right_ops_and_catches_wrong_ones():
    assert check_fused_ops(FusedCpu()) == "checked rms_norm, norm_add_norm, silu_and_mul, rotary"
    for broken in ("rms_norm", *BROKEN_NORM_ADD_NORM, "rotary"):
        with pytest.raises(AssertionError, match=re.escape(broken)):
            check_fused_ops(FusedCpu(broken))
    assert "no fused ops" in check_fused_ops(CpuHal())


def test_cli_reports_versions_and_level_for_an_absent_gpu():
    if hal.get_class("rocm").is_available():
        pytest.skip("a ROCm GPU is present")
    proc = subprocess.run([sys.executable, "-m", "hal.conformance", "hal=rocm"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "not available on this machine" in proc.stderr
    assert f"torch={torch.__version__}" in proc.stdout and "acceptance level: none" in proc.stdout
    assert versions()["torch"] == torch.__version__
