"""Test helpers: golden cases, real-model configs, Hal availability."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(os.environ.get("LOOPSTACK_GOLDEN", Path(__file__).parent / "data" / "golden"))
CONFIGS = ROOT / "zoo" / "configs"
VENDOR_MARKS = ("cuda", "rocm", "ascend")


class GoldenCase(NamedTuple):
    name: str
    path: Path
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def num_prompts(self) -> int:
        return self.meta["num_prompts"]

    def prompt(self, i: int) -> list[int]:
        return self.tensors[f"prompt_{i}"].tolist()

    def greedy(self, i: int) -> list[int]:
        return self.tensors[f"greedy_{i}"].tolist()


def golden_case(name: str) -> GoldenCase:
    path = GOLDEN / name
    return GoldenCase(name, path, json.loads((path / "golden.json").read_text()),
                      load_file(str(path / "golden.safetensors")))


def golden_names(family: str | None = None) -> list[str]:
    names = sorted(p.name for p in GOLDEN.iterdir() if (p / "golden.json").is_file())
    if family:
        names = [n for n in names if json.loads((GOLDEN / n / "golden.json").read_text())["family"] == family]
    return names


@pytest.fixture
def single_thread():
    """Tiny models: intra-op threads only add fork-join overhead (and thrash on a busy machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def count_step_kinds(monkeypatch, kinds: tuple[str, ...]) -> dict[str, int]:
    """How many steps `ModelRunner` ran through each `_execute_<kind>` (counted as they run)."""
    from runtime.execution.runner import ModelRunner

    counts = dict.fromkeys(kinds, 0)
    for kind in kinds:
        original = getattr(ModelRunner, f"_execute_{kind}")

        def counted(self, *args, _kind=kind, _original=original, **kwargs):
            counts[_kind] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, f"_execute_{kind}", counted)
    return counts


def hal_available(name: str) -> bool:
    import hal

    try:
        return hal.get_class(name).is_available()
    except Exception:
        return False
