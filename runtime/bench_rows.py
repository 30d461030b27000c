"""Benchmark rows out: `runtime.bench` (`output=`) and the tools (`--out`) append one JSON object per
line as each row is measured.

Why: a row written as soon as it is measured survives a run cut short by its time limit (the device
calls' `timeout`), and every tool writes the format runtime.bench does.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any


def append_rows(path: str | None, rows: Iterable[dict[str, Any]]) -> None:
    """Append `rows` to `path` as JSON lines; nothing where `path` is empty or None."""
    if not path:
        return
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
