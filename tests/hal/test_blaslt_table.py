"""The cuBLASLt algorithm table (hal/cuda/blaslt_table.py) is well formed, and the switch that turns it
off refuses a misspelt value; no GPU needed (tests/cuda/test_blaslt_cuda.py runs the library)."""
import pytest

from hal.cuda import blaslt
from hal.cuda.blaslt_table import TABLES


def test_table_keys_and_ranks_are_well_formed():
    for (name, sms, version, dtype), ranks in TABLES.items():
        assert isinstance(name, str) and sms > 0 and version > 0 and dtype in ("bfloat16", "float16")
        for (m, n, k), choice in ranks.items():
            assert m > 0 and n > 0 and k > 0
            sm_target, rank = choice if isinstance(choice, tuple) else (0, choice)
            assert 0 <= sm_target <= sms and 0 <= rank < blaslt.MAX_CANDIDATES


def test_switch_refuses_a_misspelt_value(monkeypatch):
    monkeypatch.setenv(blaslt.ENV, "yes")
    with pytest.raises(ValueError, match="LOOPSTACK_BLASLT"):
        blaslt.table_linear()
    monkeypatch.setenv(blaslt.ENV, "0")
    assert blaslt.table_linear() is None


def test_library_is_torchs_copy_before_any_on_the_loader_path(monkeypatch):
    """A CUDA 13 cuBLASLt earlier on the loader's path must not stand in for the one torch mapped."""
    import ctypes

    from hal.cuda import driver

    tried = []

    def cdll(name):
        tried.append(name)
        raise OSError(f"{name}: simulated")

    monkeypatch.setattr(driver, "loaded_library", lambda stem: f"/torch/lib/{stem}.so.12")
    monkeypatch.setattr(ctypes, "CDLL", cdll)
    with pytest.raises(OSError):
        blaslt._load()
    assert tried[0] == "/torch/lib/libcublasLt.so.12"


def test_handle_is_made_on_the_hals_device(monkeypatch):
    """The Hal of cuda:1 asks while cuda:0 is current: the handle must still be cuda:1's."""
    import contextlib
    from types import SimpleNamespace

    import torch

    current = [0]

    @contextlib.contextmanager
    def device(index):
        before, current[0] = current[0], torch.device(index).index if index is not None else current[0]
        try:
            yield
        finally:
            current[0] = before

    made_on = []

    class FakeLt:
        version = -1                            # no table: table_linear answers None after making it

        def __init__(self):
            made_on.append(current[0])

    monkeypatch.delenv(blaslt.ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d=None: SimpleNamespace(name="NVIDIA H200", multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(blaslt, "BlasLt", FakeLt)
    assert blaslt.table_linear(torch.device("cuda", 1)) is None
    assert made_on == [1] and current == [0]
