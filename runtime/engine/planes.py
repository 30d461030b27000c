"""Where a looped model's KV lives: `PlaneLayout`, made once from `kv_mode` and the model's fixed planes.

A model writes KV to logical planes: `0 .. F-1` are written once per token (Huginn's prelude and
coda layers), `F + d` by loop d. The KV mode decides the physical planes a request owns and what a
decoding token that exits early (Ouro's gate, `exit_threshold < 1`) leaves behind:
- `full`: one physical plane per loop, and every loop runs for every token: every plane's KV is
  exact (the reference semantics);
- `last_exited`: one plane per loop; a decoding token stops at its exit loop and its KV is copied
  into the deeper planes it skipped, so later tokens find it there;
- `shared`: a single loop plane that every loop overwrites (about loops-times less memory); a
  decoding token stops at its exit loop.
Prompt tokens always run every loop: later prompt tokens of the same step read their KV at every depth.
"""
from __future__ import annotations

from typing import NamedTuple


class _Mode(NamedTuple):
    shares_loop_plane: bool      # every loop writes one physical plane
    fills_skipped: bool          # an early-exited token's KV is copied into the planes it skipped
    stops_early: bool            # a decoding token may skip the loops after its exit


MODES = {
    "full": _Mode(shares_loop_plane=False, fills_skipped=False, stops_early=False),
    "last_exited": _Mode(shares_loop_plane=False, fills_skipped=True, stops_early=True),
    "shared": _Mode(shares_loop_plane=True, fills_skipped=False, stops_early=True),
}
KV_MODES = tuple(MODES)


class PlaneLayout:
    """The physical KV planes of a request and a loop, for one KV mode and model."""

    def __init__(self, kv_mode: str, num_fixed_planes: int) -> None:
        mode = MODES.get(kv_mode)
        if mode is None:
            raise ValueError(f"kv_mode must be one of {', '.join(KV_MODES)}, got {kv_mode!r}")
        self.kv_mode, self.num_fixed_planes = kv_mode, num_fixed_planes
        self.shares_loop_plane, self.fills_skipped, self.stops_early = mode

    @property
    def is_exact(self) -> bool:
        """Every loop's KV is kept for every token (`full`): the reference semantics."""
        return not (self.shares_loop_plane or self.stops_early)

    def num_planes(self, num_loops: int) -> int:
        """Physical planes a request with `num_loops` loops owns."""
        return self.num_fixed_planes + (1 if self.shares_loop_plane else num_loops)

    def physical(self, plane: int) -> int:
        """Where the model's logical `plane` lives."""
        return min(plane, self.num_fixed_planes) if self.shares_loop_plane else plane

    def skipped_planes(self, exit_loop: int, num_loops: int) -> range:
        """The planes a token that stopped after `exit_loop` must be filled in (its KV copied there)."""
        if not self.fills_skipped:
            return range(0)
        return range(self.num_fixed_planes + exit_loop + 1, self.num_fixed_planes + num_loops)

    def __repr__(self) -> str:
        return f"PlaneLayout({self.kv_mode!r}, num_fixed_planes={self.num_fixed_planes})"
