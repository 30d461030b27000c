"""The packages are ours, and the wheel ships the configs the CLI needs."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT


def test_top_level_packages_come_from_this_project():
    # PyPI has unrelated old distributions named hal, zoo and runtime
    import hal
    import runtime
    import zoo

    for module in (hal, zoo, runtime):
        assert Path(module.__file__).resolve().parent.parent == ROOT, module.__file__


def test_wheel_ships_packages_and_configs(tmp_path):
    pytest.importorskip("hatchling")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("loopstack-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("hal/base.py", "hal/cpu/hal.py", "zoo/ouro/model.py", "zoo/configs/ouro-1.4b.json",
                     "runtime/generate.py", "runtime/conf/generate.yaml", "runtime/conf/hal/cpu.yaml",
                     "runtime/serve.py", "runtime/server/app.py", "runtime/conf/serve.yaml",
                     "runtime/conf/model/ouro-1.4b.yaml", "runtime/conf/model/ouro-tiny.yaml"):
        assert required in names, f"{required} missing from {wheel.name}"
    packaged = ROOT / "zoo" / "checkpoints" / "ouro-tiny"
    for file in sorted(packaged.iterdir()) if packaged.is_dir() else []:     # once the trained model is added
        assert f"zoo/checkpoints/ouro-tiny/{file.name}" in names, f"{file.name} missing from {wheel.name}"
    assert not any(n.startswith(("tests/", "conf/")) for n in names), "tests/ or a top-level conf/ leaked"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[loopstack.hal]" in text and "cpu = hal.cpu:CpuHal" in text
