"""The conformance suite, run on every Hal available here (the CPU always)."""
import subprocess
import sys

import pytest

from hal.conformance import CHECKS
from helpers import ROOT
from runtime.conformance import check_golden_greedy

ALL = {**CHECKS, "golden_greedy": check_golden_greedy}


@pytest.mark.parametrize("check", sorted(ALL))
def test_conformance(any_hal, check):
    ALL[check](any_hal)


def test_cli_passes_on_cpu():
    proc = subprocess.run([sys.executable, "-m", "hal.conformance", "hal=cpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(ALL)}/{len(ALL)} passed" in proc.stdout
    assert "acceptance level: R3 (numerics)" in proc.stdout


def test_runtime_cli_passes_the_engine_check_in():
    """`python -m runtime.conformance` reaches R3 without relying on installed entry points."""
    proc = subprocess.run([sys.executable, "-m", "runtime.conformance", "hal=cpu", "only=detect,golden_greedy"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS  golden_greedy" in proc.stdout and "2/2 passed" in proc.stdout


def test_cli_rejects_unknown_hal():
    proc = subprocess.run([sys.executable, "-m", "hal.conformance", "hal=foo"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "unknown hal 'foo'" in proc.stderr
