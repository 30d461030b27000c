"""Hal lookup: built-ins, detection, and a vendor package registered through an entry point."""
import sys
import textwrap

import pytest
import torch

import hal


def test_builtin_names_and_cpu():
    assert {"cpu", "cuda", "rocm", "ascend"} <= set(hal.names())
    cpu = hal.get("cpu")
    assert cpu.name == "cpu" and cpu.device() == torch.device("cpu") and cpu.dist_backend == "gloo"


@pytest.mark.parametrize("index, message", [(1, r"hal.device_index=1, but hal cpu sees 1 device\(s\): pick one of 0..0"),
                                            (-1, "must be a device number"), ("0", "must be a device number"),
                                            (True, "must be a device number")])
def test_a_device_index_the_hal_does_not_have_is_refused_by_name(index, message):
    with pytest.raises(ValueError, match=message):
        hal.get("cpu", device_index=index)
    assert hal.get("cpu", device_index=0).device() == torch.device("cpu")


def test_unknown_hal_lists_the_known_ones():
    with pytest.raises(hal.UnknownHalError, match="known: auto, ascend, ascend-sim, cpu, cuda, rocm"):
        hal.get("foo")


def test_unavailable_vendor_has_a_clear_error():
    if hal.get_class("cuda").is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match="not available on this machine"):
        hal.get("cuda")


def test_platform_of_devices():
    assert hal.platform_of("cpu") == "cpu"
    assert hal.platform_of(torch.device("npu", 0) if hasattr(torch, "npu") else "cpu") in ("ascend", "cpu")


@pytest.fixture
def vendor_package(tmp_path, monkeypatch):
    """An out-of-tree vendor installed as a distribution with a `loopstack.hal` entry point."""
    (tmp_path / "musa_hal.py").write_text(textwrap.dedent('''
        from hal.cpu import CpuHal

        class MusaHal(CpuHal):
            name = "musa"

            @classmethod
            def is_available(cls):
                return True
    '''))
    dist = tmp_path / "musa_hal-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: musa-hal\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[loopstack.hal]\nmusa = musa_hal:MusaHal\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "musa"
    sys.modules.pop("musa_hal", None)


def test_entry_point_vendor_is_found_and_detected(vendor_package):
    assert vendor_package in hal.names()
    instance = hal.get(vendor_package)
    assert type(instance).__name__ == "MusaHal"
    # accelerators first, then out-of-tree vendors, the CPU last
    if not any(hal.get_class(n).is_available() for n in ("ascend", "rocm", "cuda")):
        assert hal.detect() == "musa"
    from hal.conformance import run_all

    assert all(r.status != "FAIL" for r in run_all(instance)), run_all(instance)


def test_entry_point_must_name_a_hal(tmp_path, monkeypatch):
    (tmp_path / "bad_vendor.py").write_text("class NotAHal:\n    pass\n")
    dist = tmp_path / "bad_vendor-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-vendor\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[loopstack.hal]\nbad = bad_vendor:NotAHal\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TypeError, match="not a Hal subclass"):
        hal.get("bad")
