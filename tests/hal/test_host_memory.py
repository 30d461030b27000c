"""What the CPU Hal counts as free memory (the KV cache's budget): what Linux could hand out, page cache
included, not only the pages that are free this instant."""
import os

import pytest

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
