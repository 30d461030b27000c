"""The conformance suite, run on every Hal available here (the CPU always)."""
import subprocess
import sys

import pytest

from hal.conformance import CHECKS
from helpers import ROOT


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_conformance(any_hal, check):
    CHECKS[check](any_hal)


def test_cli_passes_on_cpu():
    proc = subprocess.run([sys.executable, "-m", "hal.conformance", "hal=cpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(CHECKS)}/{len(CHECKS)} passed" in proc.stdout
    assert "acceptance level: R3 (numerics)" in proc.stdout


def test_cli_rejects_unknown_hal():
    proc = subprocess.run([sys.executable, "-m", "hal.conformance", "hal=foo"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "unknown hal 'foo'" in proc.stderr
