"""Paged KV bookkeeping: a pool of fixed-size blocks and one block table per KV plane per request.

Pure Python (no tensors), so it is tested exactly on the CPU. A block holds `block_size` tokens of
one plane for every layer slot of that plane; all planes draw from one pool. How many planes a
request owns is the `PlaneLayout`'s answer (runtime/engine/planes.py).

Blocks carry reference counts: with prefix caching (runtime/engine/prefix_cache.py) several requests'
tables may hold the same block. An unreferenced block that holds cached content stays named until
the free list runs out; then the least recently released one is evicted and reused.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple, Sequence

from runtime.engine.prefix_cache import NO_HIT, BlockKey, PrefixCache, PrefixHit

class CacheUsage(NamedTuple):
    num_blocks: int
    num_free_blocks: int
    num_requests: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))   # unreferenced and holding nothing named
        self.ref_counts = [0] * num_blocks
        self.tables: dict[str, list[list[int]]] = {}     # request id -> [plane][block]
        self.cache = PrefixCache() if enable_prefix_caching else None
        self.num_registered: dict[str, int] = {}         # request id -> leading blocks offered to the cache
        # requests whose tables changed since the runner's persistent batch last looked (it clears this)
        self.changed: set[str] = set()

    # ----- queries --------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones and unreferenced cached ones (evicted on demand)."""
        return len(self.free_blocks) + (len(self.cache.evictable) if self.cache else 0)

    def blocks_per_plane(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_blocks_needed(self, request_id: str, num_planes: int, num_tokens: int,
                          hit: PrefixHit = NO_HIT) -> int:
        """Blocks leaving the free pool so that each of the request's planes holds `num_tokens` tokens
        (starting from the cached blocks of `hit` when the request holds none yet)."""
        tables = self.tables.get(request_id)
        have = len(tables[0]) if tables else hit.num_blocks
        revived = 0 if tables else hit.num_evictable
        return max(0, self.blocks_per_plane(num_tokens) - have) * num_planes + revived

    def can_allocate(self, request_id: str, num_planes: int, num_tokens: int, reserve: int = 0,
                     hit: PrefixHit = NO_HIT) -> bool:
        needed = self.num_blocks_needed(request_id, num_planes, num_tokens, hit)
        return needed + reserve <= self.num_free_blocks

    def fits_at_all(self, num_planes: int, num_tokens: int) -> bool:
        """Whether a request of this size could ever fit, with the whole cache to itself."""
        return self.blocks_per_plane(num_tokens) * num_planes <= self.num_blocks

    def block_tables(self, request_id: str) -> list[list[int]]:
        return self.tables[request_id]

    def usage(self) -> CacheUsage:
        return CacheUsage(self.num_blocks, self.num_free_blocks, len(self.tables))

    def match_prefix(self, keys: Sequence[Sequence[BlockKey]]) -> PrefixHit:
        """The longest run of leading blocks cached in every plane (`keys: [plane][block]`); changes
        nothing."""
        if self.cache is None or not keys:
            return NO_HIT
        self.cache.num_queries += 1
        tables: list[list[int]] = [[] for _ in keys]
        for j in range(min(len(k) for k in keys)):
            found = [self.cache.block_of.get(plane[j]) for plane in keys]
            if None in found:
                break
            for table, block in zip(tables, found):
                table.append(block)
        if not tables[0]:
            return NO_HIT
        self.cache.num_hits += 1
        return PrefixHit(tables, sum(self.ref_counts[b] == 0 for t in tables for b in t))

    # ----- actions --------------------------------------------------------------------------
    def allocate(self, request_id: str, num_planes: int, num_tokens: int, hit: PrefixHit = NO_HIT) -> None:
        """Grow the request's tables so every plane holds `num_tokens` tokens; a new request may start
        from the cached blocks of `hit` (they gain a reference)."""
        needed = self.num_blocks_needed(request_id, num_planes, num_tokens, hit)
        if needed > self.num_free_blocks:
            raise MemoryError(f"request {request_id} needs {needed} KV blocks, {self.num_free_blocks} are free")
        if request_id not in self.tables:
            assert not hit.tables or len(hit.tables) == num_planes
            self.changed.add(request_id)
            self.tables[request_id] = [list(t) for t in hit.tables] or [[] for _ in range(num_planes)]
            for block in (b for t in hit.tables for b in t):
                if self.ref_counts[block] == 0:
                    del self.cache.evictable[block]
                self.ref_counts[block] += 1
        tables = self.tables[request_id]
        assert len(tables) == num_planes, "a request's plane count cannot change"
        target = self.blocks_per_plane(num_tokens)
        if len(tables[0]) < target:
            self.changed.add(request_id)
        for table in tables:
            if len(table) < target:
                table.extend(self._take_many(target - len(table)))

    def fork(self, parent_id: str, child_id: str, num_blocks: int) -> int:
        """A new request `child_id` starts with the parent's first `num_blocks` blocks of every plane
        (n > 1: samples share their prompt's KV); they gain a reference, so either may finish first.
        Returns the blocks per plane shared (fewer when the parent holds fewer)."""
        assert child_id not in self.tables, f"request {child_id} already holds blocks"
        tables = self.tables.get(parent_id)
        shared = min([num_blocks] + [len(t) for t in tables]) if tables else 0
        if shared <= 0:
            return 0
        self.tables[child_id] = [list(t[:shared]) for t in tables]
        self.changed.add(child_id)
        for block in (b for t in self.tables[child_id] for b in t):
            self.ref_counts[block] += 1
        return shared

    def _take_many(self, num_blocks: int) -> list[int]:
        """`num_blocks` blocks, each with one reference: free ones first, then the oldest cached
        ones. In bulk because a long prompt takes thousands (8k tokens x 4 planes: 2,048 blocks)
        before its first kernel can start."""
        pop = self.free_blocks.popleft
        blocks = [pop() for _ in range(min(num_blocks, len(self.free_blocks)))]
        blocks += [self.cache.evict_oldest() for _ in range(num_blocks - len(blocks))]
        counts = self.ref_counts
        for block in blocks:
            counts[block] = 1
        return blocks

    def trim(self, request_id: str, num_tokens: int) -> int:
        """Shrink every plane of the request's tables to the blocks `num_tokens` tokens need (after
        speculation rejected drafted tokens); returns how many blocks went back to the pool. The
        slots of positions >= the request's computed tokens hold stale KV: every later step writes
        a position in every plane it reads before attending to it, so stale KV is never read."""
        tables = self.tables.get(request_id)
        if not tables:
            return 0
        keep = self.blocks_per_plane(num_tokens)
        dropped = [b for table in tables for b in table[keep:]]
        if dropped:
            self.changed.add(request_id)
        for table in tables:
            del table[keep:]
        self._release(dropped)
        return len(dropped)

    def free(self, request_id: str) -> int:
        """Drop the request's references; returns how many table slots it held. Blocks nobody holds
        return to the pool: named ones stay cached (evictable, the tail of a table first)."""
        tables = self.tables.pop(request_id, [])
        self.num_registered.pop(request_id, None)
        self.changed.add(request_id)
        self._release([b for table in tables for b in table])
        return sum(len(t) for t in tables)

    def _release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block (the tail first): unheld blocks go back to the pool, or
        stay cached and evictable when the prefix cache names them."""
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.cache is not None and block in self.cache.key_of:
                    self.cache.evictable[block] = None
                else:
                    self.free_blocks.append(block)

    def register(self, request_id: str, keys: Sequence[Sequence[BlockKey]]) -> None:
        """Offer the request's leading full blocks (`keys: [plane][block]`, their content names) to the
        prefix cache. A key already cached by another block is left alone (this block stays private)."""
        if self.cache is None or request_id not in self.tables or not keys:
            return
        tables = self.tables[request_id]
        done = self.num_registered.get(request_id, 0)
        for j in range(done, len(keys[0])):
            for table, plane_keys in zip(tables, keys):
                self.cache.insert(plane_keys[j], table[j])
        self.num_registered[request_id] = max(done, len(keys[0]))

    def check_invariants(self) -> None:
        """Every block is free, evictable-cached, or referenced exactly as often as tables hold it."""
        held = [b for tables in self.tables.values() for table in tables for b in table]
        counts = [0] * self.num_blocks
        for b in held:
            counts[b] += 1
        assert counts == self.ref_counts, "a KV block's reference count is wrong"
        evictable = list(self.cache.evictable) if self.cache else []
        unreferenced = sorted(list(self.free_blocks) + evictable)
        assert unreferenced == [b for b in range(self.num_blocks) if counts[b] == 0], "a KV block leaked"
        if self.cache is not None:
            assert all(b in self.cache.key_of for b in evictable) and \
                not any(b in self.cache.key_of for b in self.free_blocks), "cached/free lists disagree"
            assert all(self.cache.block_of[k] == b for b, k in self.cache.key_of.items())
