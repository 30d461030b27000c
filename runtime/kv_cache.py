"""Paged KV bookkeeping: a pool of fixed-size blocks and one block table per KV plane per request.

Pure Python (no tensors), so it is tested exactly on the CPU. A block holds `block_size` tokens of
one plane for every layer slot of that plane; all planes draw from one pool. KV modes decide how
many planes a request owns: `full` and `last_exited` one per loop (plus the model's fixed planes),
`shared` a single loop plane that every loop overwrites.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

KV_MODES = ("full", "last_exited", "shared")


def num_request_planes(kv_mode: str, num_fixed_planes: int, num_loops: int) -> int:
    """KV planes a request with `num_loops` loops owns."""
    if kv_mode not in KV_MODES:
        raise ValueError(f"kv_mode must be one of {', '.join(KV_MODES)}, got {kv_mode!r}")
    return num_fixed_planes + (1 if kv_mode == "shared" else num_loops)


def physical_plane(kv_mode: str, num_fixed_planes: int, plane: int) -> int:
    """Where a model's logical plane lives: in `shared` mode every loop plane is one plane."""
    return min(plane, num_fixed_planes) if kv_mode == "shared" else plane


class CacheUsage(NamedTuple):
    num_blocks: int
    num_free_blocks: int
    num_requests: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[list[int]]] = {}     # request id -> [plane][block]

    # ----- queries --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_per_plane(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, request_id: str, num_planes: int, num_tokens: int) -> int:
        """New blocks the request needs so that each of its planes holds `num_tokens` tokens."""
        tables = self.tables.get(request_id)
        have = len(tables[0]) if tables else 0
        return max(0, self.blocks_per_plane(num_tokens) - have) * num_planes

    def can_allocate(self, request_id: str, num_planes: int, num_tokens: int, reserve: int = 0) -> bool:
        return self.num_blocks_needed(request_id, num_planes, num_tokens) + reserve <= self.num_free_blocks

    def fits_at_all(self, num_planes: int, num_tokens: int) -> bool:
        """Whether a request of this size could ever fit, with the whole cache to itself."""
        return self.blocks_per_plane(num_tokens) * num_planes <= self.num_blocks

    def block_tables(self, request_id: str) -> list[list[int]]:
        return self.tables[request_id]

    def usage(self) -> CacheUsage:
        return CacheUsage(self.num_blocks, self.num_free_blocks, len(self.tables))

    # ----- actions --------------------------------------------------------------------------
    def allocate(self, request_id: str, num_planes: int, num_tokens: int) -> None:
        """Grow the request's tables so every plane holds `num_tokens` tokens."""
        needed = self.num_blocks_needed(request_id, num_planes, num_tokens)
        if needed > self.num_free_blocks:
            raise MemoryError(f"request {request_id} needs {needed} KV blocks, {self.num_free_blocks} are free")
        tables = self.tables.setdefault(request_id, [[] for _ in range(num_planes)])
        assert len(tables) == num_planes, "a request's plane count cannot change"
        target = self.blocks_per_plane(num_tokens)
        for table in tables:
            while len(table) < target:
                table.append(self.free_blocks.popleft())

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Shrink every plane of the request's tables to the blocks `num_tokens` tokens need (after
        speculation rejected drafted tokens); returns how many blocks went back to the pool. The
        slots of positions >= the request's computed tokens hold stale KV: every later step writes
        a position in every plane it reads before attending to it, so stale KV is never read."""
        tables = self.tables.get(request_id)
        if not tables:
            return 0
        keep = self.blocks_per_plane(num_tokens)
        freed = [b for table in tables for b in table[keep:]]
        for table in tables:
            del table[keep:]
        self.free_blocks.extend(freed)
        return len(freed)

    def free(self, request_id: str) -> int:
        """Return all of the request's blocks to the pool; returns how many."""
        tables = self.tables.pop(request_id, [])
        freed = [b for table in tables for b in table]
        self.free_blocks.extend(freed)
        return len(freed)

    def check_invariants(self) -> None:
        """Every block is either free or owned by exactly one table slot."""
        owned = [b for tables in self.tables.values() for table in tables for b in table]
        every = owned + list(self.free_blocks)
        assert sorted(every) == list(range(self.num_blocks)), "a KV block leaked or is owned twice"
