"""Is there an Ascend NPU here? Answered without importing torch_npu, which initialises the
runtime once per process (and fails outright without CANN).

The rule: `torch_npu` is installed (`importlib.util.find_spec`, no import), `ASCEND_RT_VISIBLE_DEVICES`
is not set to an empty list, and the driver shows a device: a `/dev/davinci<N>` node (what the
driver creates per NPU, and what containers get mapped) or `npu-smi` on PATH. Set
`LOOPSTACK_ASCEND_SIM=1` to get the CPU simulation instead (then this is always True).
"""
from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import shutil

SIM_ENV = "LOOPSTACK_ASCEND_SIM"                       # 1: run hal=ascend as a CPU simulation
SIM_ANY_SHAPE_ENV = "LOOPSTACK_ASCEND_SIM_ANY_SHAPE"   # 1: the simulation lifts the fused-op shape limits
VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def npu_present() -> bool:
    """torch_npu installed and an NPU visible to the driver, without touching the runtime."""
    if importlib.util.find_spec("torch_npu") is None:
        return False
    visible = os.environ.get(VISIBLE_DEVICES_ENV)
    if visible is not None and not visible.strip():
        return False
    return bool(glob.glob("/dev/davinci[0-9]*")) or shutil.which("npu-smi") is not None


def torch_npu_version() -> str:
    try:
        return importlib.metadata.version("torch-npu")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cann_version_from_files() -> str:
    """The CANN toolkit version from its install-info file (what `set_env.sh` points at)."""
    home = os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME") or ""
    for root in [r for r in (home, "/usr/local/Ascend/ascend-toolkit/latest") if r]:
        found = glob.glob(os.path.join(root, "ascend_toolkit_install.info")) + \
            glob.glob(os.path.join(root, "*", "ascend_toolkit_install.info"))
        for path in sorted(found):
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("version="):
                        return line.strip().split("=", 1)[1]
    return "not found"
