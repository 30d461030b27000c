"""tests/kernels: the Triton kernels of hal/kernels on the CPU.

Numerics run in the Triton interpreter (`interpreted` fixture: modules opt in with
`pytestmark = pytest.mark.usefixtures("interpreted")`); the cross-compile checks (test_xcompile.py)
compile real code for gfx942/gfx950/sm_90 in the same session. Each cross-compile test's rows are
recorded as a junit property; the whole table is printed in the terminal summary with `-rA` (or `-v`),
by tests/conftest.py, which pytest-xdist's controller loads (it collects no test module's conftest).
"""
from __future__ import annotations

import importlib.util

import pytest

if importlib.util.find_spec("triton") is None:     # triton ships for Linux only (pyproject: dev extra)
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="module")
def interpreted():
    """Run the kernels launched by this module's tests in the Triton interpreter (with bf16 fixes)."""
    from interp import interpreter

    with interpreter():
        yield
