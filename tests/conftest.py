"""Shared fixtures: vendor markers, deterministic seeds, one Hal per available vendor."""
from __future__ import annotations

import os

# BLAS may otherwise use fewer threads on a busy machine, which changes float32 reduction order
# from run to run; greedy-equality tests need the same rounding every time
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
os.environ.setdefault("OMP_DYNAMIC", "FALSE")

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers import VENDOR_MARKS, hal_available


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for vendor in VENDOR_MARKS:
            # a marker, not `vendor in item.keywords`: keywords also hold folder names (a checkout named "ascend")
            if item.get_closest_marker(vendor) is not None and not hal_available(vendor):
                item.add_marker(pytest.mark.skip(reason=f"needs {vendor} hardware"))


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
