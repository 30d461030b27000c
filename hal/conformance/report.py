"""Acceptance levels and versions for the conformance report, the same for every vendor.

A level is reached when every check of it and of every level below it passed; a skipped or
not-run check leaves its level unverified. So "R2" on an MI300X means: it detects the GPU (R0),
its memory, streams, host buffers, graphs and collectives work (R1), and its attention and fused
kernels compile, run and match the reference (R2), but the golden numerics were not shown (R3).
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import torch

from hal.conformance.checks import CheckResult

LEVELS = (
    ("R0", "smoke: the Hal constructs, detects its device and runs a kernel"),
    ("R1", "runtime: memory, streams and events, host buffers, graphs, collectives"),
    ("R2", "kernels: paged attention, KV-cache ops, dense attention and fused ops match the reference"),
    ("R3", "numerics: the golden cases' greedy tokens and logits through the runtime"),
)
CHECK_LEVELS = {
    "detect": 0,
    "memory": 1, "streams_events": 1, "host_buffer": 1, "graph_replay": 1, "comm_one_rank": 1,
    "paged_attention": 2, "kv_round_trip": 2, "dense_attention": 2, "fused_ops": 2, "quantized_kv": 2,
    "fp8_linear": 2,
    "golden_greedy": 3,
}
UNLISTED_LEVEL = 1           # a check added without a level still lowers the level when it fails
DISTRIBUTIONS = ("triton", "pytorch-triton-rocm", "pytorch-triton", "cuda-bindings", "cuda-python",
                 "torch-npu")


class LevelStatus(NamedTuple):
    code: str                # "R0" .. "R3"
    meaning: str
    status: str              # PASS | FAIL | UNVERIFIED
    blockers: list[str]      # "check STATUS" for every check that is not PASS


def level_of(check: str) -> int:
    return CHECK_LEVELS.get(check, UNLISTED_LEVEL)


def level_statuses(results: Sequence[CheckResult], all_checks: Iterable[str]) -> list[LevelStatus]:
    """One status per level; checks in `all_checks` with no result count as not run."""
    by_name = {r.name: r.status for r in results}
    statuses = []
    for index, (code, meaning) in enumerate(LEVELS):
        names = [n for n in all_checks if level_of(n) == index]
        blockers = [f"{n} {by_name.get(n, 'NOT RUN')}" for n in names if by_name.get(n) != "PASS"]
        failed = any(by_name.get(n) == "FAIL" for n in names)
        statuses.append(LevelStatus(code, meaning, "FAIL" if failed else "UNVERIFIED" if blockers else "PASS",
                                    blockers))
    return statuses


def level_reached(statuses: Sequence[LevelStatus]) -> str | None:
    """The highest level whose checks, and all lower levels' checks, passed (None: not even R0)."""
    reached = None
    for level in statuses:
        if level.status != "PASS":
            break
        reached = level.code
    return reached


def format_levels(statuses: Sequence[LevelStatus]) -> list[str]:
    lines = [f"{s.code} {s.status:10s} {s.meaning}" + (f" [{'; '.join(s.blockers)}]" if s.blockers else "")
             for s in statuses]
    reached = level_reached(statuses)
    meaning = dict(LEVELS).get(reached or "", "")
    lines.append(f"acceptance level: {reached} ({meaning.split(':')[0]})" if reached
                 else "acceptance level: none (R0 not reached)")
    return lines


def versions() -> dict[str, str]:
    """python, torch, its CUDA / HIP build, the ROCm install, and the vendor packages present."""
    out = {"python": platform.python_version(), "torch": torch.__version__}
    if getattr(torch.version, "cuda", None):
        out["cuda"] = str(torch.version.cuda)
    if getattr(torch.version, "hip", None):
        out["hip"] = str(torch.version.hip)
        rocm_info = Path(os.environ.get("ROCM_PATH", "/opt/rocm")) / ".info" / "version"
        if rocm_info.is_file():
            out["rocm"] = rocm_info.read_text().strip()
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out
