"""tools/persistent_chain_probe.py's kernel in the Triton interpreter: one program walks a chain of
eight products (its grid barrier never waits) and matches torch. The GPU timings are docs/performance.md's
lever 96; this keeps the probe runnable."""
from __future__ import annotations

import pytest

import persistent_chain_probe as probe

pytestmark = pytest.mark.usefixtures("interpreted")


def test_one_program_runs_the_chain_as_torch():
    assert probe.check() == 0
