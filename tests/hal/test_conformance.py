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


@pytest.mark.parametrize("args,needle,code", [
    (["only=bogus"], "only= takes check names, got 'bogus'; the checks: detect,", 2),
    (["only="], "only= takes check names", 2),
    (["device_index=abc"], "device_index= takes a device number", 2),
    (["hal=cpu", "attention_backend=bogus"], "hal cpu has no attention backend 'bogus'", 2),
    (["--help"], "usage: python -m hal.conformance hal=<auto|", 0)])
def test_cli_arguments_it_cannot_use_end_in_one_line(args, needle, code):
    """Before, only=bogus ran nothing and passed ("0/0 passed", status 0), a bad backend name failed
    the kernels' checks with tracebacks, and --help was "not understood"."""
    proc = subprocess.run([sys.executable, "-m", "hal.conformance", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == code and needle in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
