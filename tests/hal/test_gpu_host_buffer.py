"""The CUDA/ROCm host-buffer logic that runs without a GPU: the staged dirty-row copy (on CPU
tensors) and the mapping probe's verdicts on a true alias, a stale copy and a failing driver."""
import pytest
import torch

from hal.cuda.host_buffer import PROBE_LEN, StagedHostBuffer, probe_mapping


def _rows(num_rows: int, width: int) -> torch.Tensor:
    return torch.randint(1, 1 << 30, (num_rows, width), dtype=torch.int32)


def test_staged_copy_moves_only_dirty_rows_to_a_fixed_address():
    buf = StagedHostBuffer((4, 3), torch.int32, torch.device("cpu"))
    first = _rows(4, 3)
    buf.host.copy_(first)
    buf.mark_dirty()
    view = buf.device_view()
    assert torch.equal(view, first) and view.data_ptr() != buf.host.data_ptr()
    second = _rows(4, 3)
    buf.host.copy_(second)
    buf.mark_dirty(1, 3)
    assert buf.device_view().data_ptr() == view.data_ptr()
    assert torch.equal(view[1:3], second[1:3]) and torch.equal(view[[0, 3]], first[[0, 3]])
    buf.mark_dirty(0, 1)
    buf.mark_dirty(3, 4)                               # two ranges merge into one copy of rows 0..3
    assert torch.equal(buf.device_view(), second)
    third = _rows(4, 3)
    buf.host.copy_(third)
    assert torch.equal(buf.device_view(), second)     # nothing marked: nothing copied


def test_staged_buffer_rejects_bad_rows_and_shapes():
    buf = StagedHostBuffer((4, 3), torch.int32, torch.device("cpu"))
    with pytest.raises(IndexError, match=r"mark_dirty\(2, 9\)"):
        buf.mark_dirty(2, 9)
    for shape in ((), (0, 3)):
        with pytest.raises(ValueError, match="at least one dimension"):
            StagedHostBuffer(shape, torch.int32, torch.device("cpu"))


class Alias:
    """A 'mapped' buffer whose device view is the host memory itself (what a working mapping is)."""

    def __init__(self, shape, dtype):
        self.host = torch.zeros(shape, dtype=dtype)

    def device_view(self):
        return self.host


class StaleCopy(Alias):
    """A 'mapping' that is really a copy taken once: host writes never reach it."""

    def device_view(self):
        return self.host.clone()


def test_probe_maps_only_when_the_device_sees_host_writes():
    ok = probe_mapping(Alias)
    assert ok.is_mapped and "two rounds" in ok.reason
    stale = probe_mapping(StaleCopy)
    assert not stale.is_mapped and f"of {PROBE_LEN} values wrong" in stale.reason


def test_probe_reports_a_driver_failure():
    def refuse(shape, dtype):
        raise OSError("hipHostGetDevicePointer(0x7f00) failed with error 1")

    verdict = probe_mapping(refuse)
    assert not verdict.is_mapped and "hipHostGetDevicePointer(0x7f00) failed" in verdict.reason
