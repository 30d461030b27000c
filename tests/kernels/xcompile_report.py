"""How the cross-compile table reaches the terminal summary: test_xcompile.py adds each test's rows to
the session's stash as it runs; under pytest-xdist each worker hands its rows to the controller
(tests/conftest.py), which prints them all as one table."""
from __future__ import annotations

import pytest

XCOMPILE_ROWS = pytest.StashKey[list[str]]()


def add_rows(config: pytest.Config, rows: list[str]) -> None:
    config.stash.setdefault(XCOMPILE_ROWS, []).extend(rows)


def summary(config: pytest.Config) -> str | None:
    """The table of every row this session compiled (sorted: table, kernel, target), or None."""
    rows = config.stash.get(XCOMPILE_ROWS, [])
    if not rows:
        return None
    import xcompile

    return xcompile.with_head(sorted(rows))
