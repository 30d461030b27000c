"""What the CPU Hal counts as free memory (the KV cache's budget): what Linux could hand out, page cache
included, not only the pages that are free this instant; and how it allocates that cache (zeroed
pages taken as they are first written)."""
import os

import pytest
import torch

from hal.common.host import HostDevice, available_memory


def test_available_memory_reads_mem_available_not_mem_free(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          500000 kB\n"
                       "MemAvailable:   18000000 kB\nCached:         16000000 kB\n")
    assert available_memory(str(meminfo)) == 18000000 * 1024
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:          500000 kB\n")
    assert available_memory(str(meminfo)) is None
    assert available_memory(str(tmp_path / "absent")) is None


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="Linux only")
def test_the_cpu_budget_counts_reclaimable_memory():
    free_pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    info = HostDevice().mem_info()
    # MemAvailable >= MemFree on Linux (it adds what the kernel can reclaim); the two reads are apart
    # in time, so allow some drift
    assert info.free_bytes >= free_pages - (256 << 20)
    assert info.free_bytes <= info.total_bytes


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="Linux only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_a_host_kv_pool_takes_memory_as_it_is_written(dtype):
    """The KV pool on the CPU (`Hal.zeros`): 2 GiB of zeros at once, without writing them (torch.zeros
    would make all 2 GiB resident and take about 1.5 s); what is written reads back, the rest is 0."""
    num_bytes = 2 << 30
    shape = (64, num_bytes // 64 // dtype.itemsize)
    before = _resident_bytes()
    pool = HostDevice().zeros(shape, dtype)
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    pool[3, 5:9] = 1.0
    assert pool[3, 5:9].float().tolist() == [1.0] * 4
    assert pool[3, :5].float().abs().sum() == 0 and pool[-1, -4:].float().abs().sum() == 0
    assert pool[::7, ::4099].float().abs().sum() == 0
    assert _resident_bytes() - before < (64 << 20)
