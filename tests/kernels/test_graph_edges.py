"""tools/graph_edges.py's ctypes mirrors of the driver's structs: `cuGraphGetEdges` fills an array of
`CUgraphEdgeData` (8 bytes each) and `cuGraphKernelNodeGetParams` a `CUDA_KERNEL_NODE_PARAMS_v2`, whose
`kern` field the probe reads when `func` is null. A wrong layout would misread every edge on the GPU
(docs/performance.md, lever 98), so the offsets are pinned here against cuda.h's declarations."""
from __future__ import annotations

import ctypes

import pytest

edges = pytest.importorskip("graph_edges", exc_type=ImportError)


def test_edge_data_is_cuda_h_layout():
    data = edges._EdgeData
    assert ctypes.sizeof(data) == 8
    assert (data.from_port.offset, data.to_port.offset, data.type.offset) == (0, 1, 2)


def test_kernel_node_params_v2_layout():
    params = edges._KernelNodeParams
    # CUfunction func; unsigned grid[3], block[3], sharedMemBytes; void **kernelParams, **extra;
    # CUkernel kern; CUcontext ctx
    fields = ("func", "grid", "block", "shared_mem_bytes", "kernel_params", "extra", "kern", "ctx")
    assert [getattr(params, name).offset for name in fields] == [0, 8, 20, 32, 40, 48, 56, 64]
    assert ctypes.sizeof(params) == 72


def test_name_matcher_searches():
    waits = edges.name_matcher(r"^nvjet_.*_splitK_|splitKreduce")
    assert waits("nvjet_sm90_tst_64x64_64x13_4x1_v_bz_splitK_TNT")
    assert waits("_ZN8cublasLt19splitKreduce_kernelILi32E")
    assert not waits("nvjet_sm90_tst_64x64_64x13_4x1_v_bz_TNT")
