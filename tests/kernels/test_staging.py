"""The pinned staging ring of captured metadata: a host mirror whose copy may still be queued is
never rewritten before the event recorded after that copy has been waited on."""
from __future__ import annotations

import numpy as np
import torch

from hal.common.staging import StagingRing


class FakeEvent:
    def __init__(self, log: list) -> None:
        self.log, self.is_recorded, self.is_waited = log, False, False

    def record(self) -> None:
        self.is_recorded = True

    def synchronize(self) -> None:
        self.is_waited = True
        self.log.append(self)


def test_ring_waits_before_reusing_a_slot_and_keeps_queued_values():
    rng = np.random.default_rng(7)
    steps = [rng.integers(0, 1000, size=(5,), dtype=np.int32) for _ in range(5)]
    target = torch.zeros(5, dtype=torch.int32)
    waited, made = [], []

    def make_event():
        made.append(FakeEvent(waited))
        return made[-1]

    ring = StagingRing([steps[0]], torch.device("cpu"), depth=2, make_event=make_event)
    for i, values in enumerate(steps):
        ring.stage([values], [target])
        assert torch.equal(target, torch.from_numpy(values))
        assert made[i].is_recorded
        if i >= 1:
            # the other slot still holds the previous step's values: its copy may still be queued
            previous = ring.slots[(i - 1) % 2][0]
            assert torch.equal(previous, torch.from_numpy(steps[i - 1]))
        # step i reused slot i % 2 only after waiting on the event of step i - 2
        assert waited == made[:max(0, i - 1)]


def test_ring_rejects_a_batch_of_another_shape():
    ring = StagingRing([np.zeros(4, dtype=np.int32)], torch.device("cpu"))
    try:
        ring.stage([np.ones(3, dtype=np.int32)], [torch.zeros(4, dtype=torch.int32)])
    except ValueError as exc:
        assert "does not fit the captured meta" in str(exc)
    else:
        raise AssertionError("a mismatched shape was staged")
