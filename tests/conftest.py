"""Shared fixtures: vendor markers, deterministic seeds, one Hal per available vendor; the cross-compile
table's summary (tests/kernels/xcompile_report.py)."""
from __future__ import annotations

import os

# BLAS may otherwise use fewer threads on a busy machine, which changes float32 reduction order
# from run to run; greedy-equality tests need the same rounding every time
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
os.environ.setdefault("OMP_DYNAMIC", "FALSE")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import VENDOR_MARKS, hal_available
from xcompile_report import XCOMPILE_ROWS, add_rows, summary


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for vendor in VENDOR_MARKS:
            # a marker, not `vendor in item.keywords`: keywords also hold folder names (a checkout named "ascend")
            if item.get_closest_marker(vendor) is not None and not hal_available(vendor):
                item.add_marker(pytest.mark.skip(reason=f"needs {vendor} hardware"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker per core this process may use, at most 8 (each worker loads torch and models)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))


def pytest_sessionfinish(session: pytest.Session) -> None:
    output = getattr(session.config, "workeroutput", None)      # a pytest-xdist worker's, for its controller
    if output is not None:
        output["xcompile_rows"] = session.config.stash.get(XCOMPILE_ROWS, [])


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:       # pytest-xdist's controller: a worker has finished
    add_rows(node.config, getattr(node, "workeroutput", {}).get("xcompile_rows", []))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    table = summary(config)
    if table and ("A" in (config.option.reportchars or "") or config.option.verbose > 0):
        terminalreporter.write_sep("-", "hal.kernels cross-compile table")
        terminalreporter.write_line(table)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture(params=["cpu", *VENDOR_MARKS])
def any_hal(request: pytest.FixtureRequest):
    """Each available Hal (device-generic tests run on every one present)."""
    if not hal_available(request.param):
        pytest.skip(f"needs {request.param}")
    import hal

    return hal.get(request.param)
