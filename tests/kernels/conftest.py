"""tests/kernels: the Triton kernels of hal/kernels on the CPU.

Numerics run in the Triton interpreter (`interpreted` fixture: modules opt in with
`pytestmark = pytest.mark.usefixtures("interpreted")`); the cross-compile checks (test_xcompile.py)
compile real code for gfx942/gfx950/sm_90 in the same session. The cross-compile table is written to
`<pytest tmp>/xcompile/table.txt`, recorded as a junit property, and printed in the terminal summary
with `-rA` (or `-v`).
"""
from __future__ import annotations

import importlib.util

import pytest

from xcompile_report import XCOMPILE_TABLE

if importlib.util.find_spec("triton") is None:     # triton ships for Linux only (pyproject: dev extra)
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="module")
def interpreted():
    """Run the kernels launched by this module's tests in the Triton interpreter (with bf16 fixes)."""
    from interp import interpreter

    with interpreter():
        yield


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    table = config.stash.get(XCOMPILE_TABLE, None)
    if not table:
        return
    verbose = "A" in (config.option.reportchars or "") or config.option.verbose > 0
    if verbose:
        terminalreporter.write_sep("-", "hal.kernels cross-compile table")
        terminalreporter.write_line(table)
