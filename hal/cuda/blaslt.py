"""Decode projections through cuBLASLt at the algorithm a measured table names (docs/performance.md
lever 99), instead of the first one its heuristic ranks, which is what `F.linear` runs.

Why: for a projection `y[M, N] = x[M, K] @ w[N, K]^T`, cuBLASLt's heuristic returns up to eight
candidate kernels and torch always takes the first. On an H200 with cuBLASLt 13.1 a lower-ranked one
streams the weights faster at some decode shapes: Nanbeige4.2-3B's o projection at 64 rows 18.4 ->
14.6 us, its down projection at one row 26.4 -> 23.9, Ouro-1.4B's gate|up at 64 rows 17.4 -> 16.1
(tools/lt_algo_probe.py, each timed in a graph over weight copies). The table
(`hal/cuda/blaslt_table.py`) holds, per device, cuBLASLt version and dtype, the heuristic rank to
run for each (M, N, K) where one won; every other product, and every process whose device or
library differs from the table's, keeps `F.linear`. The ranks are the heuristic's own order, so an
entry is valid only for the version it was measured with, which the key says.

A different kernel sums in another order: its outputs differ from `F.linear`'s in the last bits
(the probe's relative error against float32 is the same as torch's pick), so a process gets the
same tokens run after run, but not bit for bit those of a process without the table
(`LOOPSTACK_BLASLT=0`).
"""
from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hal.cuda.driver import open_library

log = logging.getLogger(__name__)

ENV = "LOOPSTACK_BLASLT"          # "0": every projection through F.linear
CUDA_R_16F, CUDA_R_16BF, CUDA_R_32F, COMPUTE_32F = 2, 14, 0, 68
DESC_TRANSA, DESC_TRANSB, DESC_SM_COUNT_TARGET = 3, 4, 15
PREF_MAX_WORKSPACE = 1
OP_N, OP_T = 0, 1
MAX_CANDIDATES = 16
MAX_WORKSPACE_BYTES = 32 << 20
ALIGNMENT = 256                   # bytes: cuBLASLt's default minimum operand alignment for its heuristic
DTYPE_CODES = {torch.bfloat16: CUDA_R_16BF, torch.float16: CUDA_R_16F}


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class Plan(NamedTuple):
    """One shape's descriptors (kept alive with the plan) and the heuristic's candidates, best first."""
    desc: ctypes.c_void_p
    layouts: tuple[ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]   # A = w, B = x, C = D = y
    candidates: tuple[HeuristicResult, ...]


def _load() -> ctypes.CDLL:
    # torch's own copy first: a newer one earlier on the loader's path (a CUDA 13 toolkit beside a
    # CUDA 12 torch) would be a second cuBLASLt whose kernels the driver may not run, found out only
    # at the first product of a shape the table names, in the middle of decoding
    lib = open_library("libcublasLt", ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"))
    vp, i32, sz, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_uint64
    signatures = {     # every argument typed: an untyped size_t would travel as a 32-bit int
        "cublasLtCreate": [vp],
        "cublasLtGetVersion": [],
        "cublasLtMatmulDescCreate": [vp, i32, i32],
        "cublasLtMatmulDescSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatrixLayoutCreate": [vp, i32, u64, u64, ctypes.c_int64],
        "cublasLtMatmulPreferenceCreate": [vp],
        "cublasLtMatmulPreferenceSetAttribute": [vp, i32, vp, sz],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i32, vp, vp],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
    }
    for fn, args in signatures.items():
        getattr(lib, fn).argtypes = args
        getattr(lib, fn).restype = sz if fn == "cublasLtGetVersion" else i32
    return lib


class BlasLt:
    """The cuBLASLt calls a projection needs, for the current CUDA device. In cuBLAS's column-major
    terms `y^T[N, M] = op_T(w as [K, N]) @ (x as [K, M])`: the same operation torch's `F.linear` asks for."""

    def __init__(self) -> None:
        self.lib = _load()
        self.version = int(self.lib.cublasLtGetVersion())
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self._plans: dict[tuple, Plan] = {}
        self._preference = ctypes.c_void_p()      # every shape asks the heuristic with the same bound
        self._check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self._preference)), "preference")
        self._set(self.lib.cublasLtMatmulPreferenceSetAttribute, self._preference, PREF_MAX_WORKSPACE,
                  ctypes.c_uint64(MAX_WORKSPACE_BYTES))

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def _set(self, setter, obj, attr: int, value: ctypes._SimpleCData) -> None:
        self._check(setter(obj, attr, ctypes.byref(value), ctypes.sizeof(value)), f"attribute {attr}")

    def plan(self, m: int, n: int, k: int, dtype: torch.dtype, sm_target: int = 0) -> Plan:
        """The heuristic's candidates for this shape; with `sm_target`, those it ranks for a kernel
        meant to run on that many SMs (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), another list."""
        key = (m, n, k, dtype, sm_target)
        if key not in self._plans:
            lib, code = self.lib, DTYPE_CODES[dtype]
            desc = ctypes.c_void_p()
            self._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), COMPUTE_32F, CUDA_R_32F), "matmul desc")
            self._set(lib.cublasLtMatmulDescSetAttribute, desc, DESC_TRANSA, ctypes.c_int32(OP_T))
            self._set(lib.cublasLtMatmulDescSetAttribute, desc, DESC_TRANSB, ctypes.c_int32(OP_N))
            if sm_target:
                self._set(lib.cublasLtMatmulDescSetAttribute, desc, DESC_SM_COUNT_TARGET, ctypes.c_int32(sm_target))
            layouts = []
            for rows, cols in ((k, n), (k, m), (n, m)):
                layout = ctypes.c_void_p()
                self._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), code, rows, cols, rows), "layout")
                layouts.append(layout)
            results, returned = (HeuristicResult * MAX_CANDIDATES)(), ctypes.c_int(0)
            a, b, c = layouts
            self._check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, self._preference,
                                                           MAX_CANDIDATES, results, ctypes.byref(returned)),
                        "heuristic")
            candidates = tuple(results[i] for i in range(returned.value) if results[i].state == 0)
            self._plans[key] = Plan(desc, (a, b, c), candidates)
        return self._plans[key]

    def linear(self, x: torch.Tensor, w: torch.Tensor, rank: int, sm_target: int = 0) -> torch.Tensor:
        """`F.linear(x, w)` for x `[M, K]` and w `[N, K]`, both with unit stride along K, through the
        heuristic's candidate `rank` at `sm_target` (raises IndexError where it offers fewer)."""
        plan = self.plan(x.shape[0], w.shape[0], x.shape[1], x.dtype, sm_target)
        return self.matmul(x, w, plan, plan.candidates[rank])

    def matmul(self, x: torch.Tensor, w: torch.Tensor, plan: Plan, algo: HeuristicResult) -> torch.Tensor:
        """`F.linear(x, w)` through `algo` (its `workspace` bytes set) under `plan`'s descriptors."""
        y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
        workspace = torch.empty(max(algo.workspace, 1), dtype=torch.uint8, device=x.device)
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        a, b, c = plan.layouts
        self._check(self.lib.cublasLtMatmul(
            self.handle, plan.desc, ctypes.byref(one), w.data_ptr(), a, x.data_ptr(), b, ctypes.byref(zero),
            y.data_ptr(), c, y.data_ptr(), c, ctypes.byref(algo.algo), workspace.data_ptr(), algo.workspace,
            torch.cuda.current_stream(x.device).cuda_stream), "cublasLtMatmul")
        return y


class TableLinear:
    """`F.linear` whose products the table names run at the table's choice: a rank of the heuristic's
    list, or `(sm_target, rank)` of its list for that SM-count target; everything else unchanged."""

    def __init__(self, lt: BlasLt, choices: dict[tuple[int, int, int], int | tuple[int, int]],
                 dtype: torch.dtype) -> None:
        self.lt, self.dtype = lt, dtype
        self.choices = {shape: c if isinstance(c, tuple) else (0, c) for shape, c in choices.items()}

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        choice = self.choices.get((x.numel() // k if k else 0, w.shape[0], k)) if x.dim() else None
        if (choice is None or x.dtype != self.dtype or w.dtype != self.dtype or w.dim() != 2
                or w.shape[1] != k or w.stride(-1) != 1 or w.stride(0) != k or not x.is_cuda):
            return F.linear(x, w)
        x2 = x.reshape(-1, k)
        if x2.stride(-1) != 1 or x2.stride(0) != k:
            x2 = x2.contiguous()
        sm_target, rank = choice
        # the heuristic listed its candidates for operands on ALIGNMENT-byte boundaries (its default
        # preference), which fresh allocations are and an offset view may not be
        plan = self.lt.plan(x2.shape[0], w.shape[0], k, x.dtype, sm_target)
        if (x2.data_ptr() | w.data_ptr()) % ALIGNMENT or rank >= len(plan.candidates):
            return F.linear(x, w)
        return self.lt.matmul(x2, w, plan, plan.candidates[rank]).view(*x.shape[:-1], w.shape[0])


def table_linear(device: torch.device | int | None = None) -> Callable[..., torch.Tensor] | None:
    """A `TableLinear` for this device where the table has entries measured on it with this cuBLASLt
    version (bf16), else None (callers keep `F.linear`). `LOOPSTACK_BLASLT=0` turns it off."""
    setting = os.environ.get(ENV, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{ENV}={setting!r}: use 1 (the measured cuBLASLt algorithms, default) or 0 (F.linear)")
    if setting == "0" or not torch.cuda.is_available():
        return None
    from hal.cuda.blaslt_table import TABLES

    props = torch.cuda.get_device_properties(device)
    try:
        with torch.cuda.device(device):    # a cuBLASLt handle belongs to the device current at its creation
            lt = BlasLt()
    except (OSError, AttributeError, RuntimeError) as exc:   # no cuBLASLt, or an older one without a symbol
        log.info("cuBLASLt algorithm table unused: %s", exc)
        return None
    choices = TABLES.get((props.name, props.multi_processor_count, lt.version, "bfloat16"))
    if not choices:
        log.info("no cuBLASLt algorithm table for %s (%d SMs) with cuBLASLt %d: F.linear's choice everywhere",
                 props.name, props.multi_processor_count, lt.version)
        return None
    return TableLinear(lt, choices, torch.bfloat16)

