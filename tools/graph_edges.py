"""Programmatic edges into the library kernels of a captured CUDA graph (sm_90+), for
tools/graph_pdl_probe.py.

Our Triton kernels launch with programmatic dependent launch (hal/kernels/pdl.py), so a captured
graph holds programmatic edges into them; the library kernels between them (cuBLAS's GEMMs, cuDNN's
attention) get plain edges, and each starts only once its predecessor has drained. An edge into a
kernel that runs `griddepcontrol.wait` (SASS `ACQBULK`) before its first dependent read may be
programmatic; into any other kernel it is a race. The probe found that most of cuBLAS 13.1's
decode-shape kernels do not wait (docs/performance.md, lever 98), so the engine does not rewrite
its graphs; this module is the probe's.

The calls are the driver API's (libcuda) through ctypes.
"""
from __future__ import annotations

import ctypes
import functools
import re
from typing import Callable, NamedTuple

from hal.cuda.driver import open_library

_NODE_KERNEL = 0              # CU_GRAPH_NODE_TYPE_KERNEL
_DEPENDENCY_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
_PORT_PROGRAMMATIC = 1        # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC


class _EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelNodeParams(ctypes.Structure):     # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem_bytes", ctypes.c_uint), ("kernel_params", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class Edge(NamedTuple):
    source: int                # CUgraphNode handles
    target: int
    data: _EdgeData


class Rewrite(NamedTuple):
    num_edges: int             # kernel -> kernel edges in the graph
    num_programmatic: int      # of those, programmatic after the rewrite
    num_converted: int         # made programmatic by this rewrite


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    return open_library("libcuda", ("libcuda.so.1", "libcuda.so"))


def _call(name: str, *args) -> None:
    lib = _driver()
    fn = getattr(lib, name + "_v2", None) or getattr(lib, name)
    err = fn(*args)
    if err:
        raise OSError(f"{name} failed with CUresult {err}")


def kernel_names(graph: int) -> dict[int, str]:
    """Kernel node handle -> the kernel's (mangled) name, for every kernel node of `graph`."""
    count = ctypes.c_size_t(0)
    _call("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(count))
    nodes = (ctypes.c_void_p * count.value)()
    _call("cuGraphGetNodes", ctypes.c_void_p(graph), nodes, ctypes.byref(count))
    names = {}
    for node in nodes:
        kind = ctypes.c_int(-1)
        _call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
        if kind.value != _NODE_KERNEL:
            continue
        params = _KernelNodeParams()
        _call("cuGraphKernelNodeGetParams", ctypes.c_void_p(node), ctypes.byref(params))
        name = ctypes.c_char_p()
        if params.func:            # a CUfunction; runtime launches may give a CUkernel instead
            _call("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(params.func))
        elif params.kern:
            _call("cuKernelGetName", ctypes.byref(name), ctypes.c_void_p(params.kern))
        names[int(node)] = (name.value or b"?").decode(errors="replace")
    return names


def edges(graph: int) -> list[Edge]:
    count = ctypes.c_size_t(0)
    _call("cuGraphGetEdges", ctypes.c_void_p(graph), None, None, None, ctypes.byref(count))
    sources, targets = (ctypes.c_void_p * count.value)(), (ctypes.c_void_p * count.value)()
    data = (_EdgeData * count.value)()
    _call("cuGraphGetEdges", ctypes.c_void_p(graph), sources, targets, data, ctypes.byref(count))
    return [Edge(int(s), int(t), d) for s, t, d in zip(sources, targets, data)]


def _replace(graph: int, edge: Edge, data: _EdgeData) -> None:
    source, target = ctypes.c_void_p(edge.source), ctypes.c_void_p(edge.target)
    old = _EdgeData.from_buffer_copy(edge.data)
    _call("cuGraphRemoveDependencies", ctypes.c_void_p(graph), ctypes.byref(source), ctypes.byref(target),
          ctypes.byref(old), ctypes.c_size_t(1))
    try:
        _call("cuGraphAddDependencies", ctypes.c_void_p(graph), ctypes.byref(source), ctypes.byref(target),
              ctypes.byref(data), ctypes.c_size_t(1))
    except OSError:                # put the edge back as it was: the graph stays as captured
        _call("cuGraphAddDependencies", ctypes.c_void_p(graph), ctypes.byref(source), ctypes.byref(target),
              ctypes.byref(old), ctypes.c_size_t(1))
        raise


def make_programmatic(graph: int, waits: Callable[[str], bool]) -> Rewrite:
    """Turn every plain kernel -> kernel edge of `graph` whose target kernel `waits` (by name) into a
    programmatic one. Call before the graph is instantiated."""
    names = kernel_names(graph)
    kernel_edges = [e for e in edges(graph) if e.source in names and e.target in names]
    converted = 0
    for edge in kernel_edges:
        if edge.data.type != _DEPENDENCY_PROGRAMMATIC and waits(names[edge.target]):
            _replace(graph, edge, _EdgeData(_PORT_PROGRAMMATIC, 0, _DEPENDENCY_PROGRAMMATIC))
            converted += 1
    programmatic = sum(e.data.type == _DEPENDENCY_PROGRAMMATIC for e in kernel_edges) + converted
    return Rewrite(len(kernel_edges), programmatic, converted)


def name_matcher(pattern: str) -> Callable[[str], bool]:
    compiled = re.compile(pattern)
    return lambda name: compiled.search(name) is not None
