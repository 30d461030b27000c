"""A pytest plugin: after each test, one JSON line with the CUDA memory allocated and reserved, the
`torch.cuda.CUDAGraph` objects still alive (collectable or not) and the threads running. It showed
the speculation tests leaving their engines' graphs behind (docs/benchmarks.md, forty-second session).

    PYTHONPATH=tools:. OUT=/tmp python3 -m pytest -m cuda tests/cuda -p cuda_graphs_left   # -> $OUT/graphs_left.jsonl
"""
import gc
import json
import os
import threading

import pytest


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.when != "teardown":
        return
    import torch

    row = {"test": report.nodeid, "threads": [t.name for t in threading.enumerate()],
           "graphs": sum(type(o).__name__ == "CUDAGraph" for o in gc.get_objects())}
    if torch.cuda.is_available():
        row.update(allocated_mib=torch.cuda.memory_allocated() >> 20, reserved_mib=torch.cuda.memory_reserved() >> 20,
                   free_mib=torch.cuda.mem_get_info()[0] >> 20)
    with open(os.path.join(os.environ.get("OUT", "."), "graphs_left.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
