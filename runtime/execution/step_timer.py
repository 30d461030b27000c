"""Device time per step: events recorded on the device around each step's work, so a benchmark can
say how long the device worked on a step and how long it sat idle waiting for the host between
steps (wall time minus overlapped device time), without adding a host sync to the step."""
from __future__ import annotations

import statistics
from typing import Any, NamedTuple


class StepTiming(NamedTuple):
    device_ms: float            # median device time of a step (first event to last)
    idle_ms: float              # median device idle time between consecutive steps (waiting for the host)
    num_steps: int


class StepTimer:
    """`start(label)` before a step's first device work, `stop()` after its last; `summary(label)`
    once the device has finished (it synchronizes on the events)."""

    def __init__(self, hal: Any) -> None:
        self.hal = hal
        self.steps: list[tuple[Any, Any, Any]] = []         # (label, start event, end event)
        self._open: tuple[Any, Any] | None = None

    def start(self, label: Any) -> None:
        event = self.hal.event(enable_timing=True)
        event.record()
        self._open = (label, event)

    def stop(self) -> None:
        if self._open is None:
            return
        event = self.hal.event(enable_timing=True)
        event.record()
        self.steps.append((*self._open, event))
        self._open = None

    def clear(self) -> None:
        self.steps.clear()

    def summary(self, label: Any, skip: int = 2) -> StepTiming | None:
        """Medians over the consecutive steps recorded with `label` (the first `skip` left out)."""
        chosen = [i for i, (lab, _, _) in enumerate(self.steps) if lab == label][skip:]
        if not chosen:
            return None
        self.steps[chosen[-1]][2].synchronize()
        device = [self.steps[i][1].elapsed_time(self.steps[i][2]) for i in chosen]
        idle = [self.steps[i][2].elapsed_time(self.steps[i + 1][1]) for i in chosen[:-1] if i + 1 in chosen]
        return StepTiming(statistics.median(device), statistics.median(idle) if idle else 0.0, len(chosen))
