"""Prefix caching: which KV blocks hold the same content, so equal prompt prefixes share them.

A full block of plane p is named by its content and everything before it: the chain digest
`d_j = H(d_{j-1}, token ids of block j)` (starting from the request's salt), plus the plane. Loop
planes hold loop d's KV, which depends only on the tokens, so a 2-loop request reuses the first two
loop planes a 4-loop request cached. Fixed planes (Huginn's coda) depend on the loop count and on
early exit, so their names carry those too. A request's hit is the longest run of blocks present
in *every* plane it owns: its prefill then skips every loop of those tokens.

Only blocks whose KV is final and exact are offered (see `PrefixPolicy.cacheable_len`). Pure Python.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import Hashable, NamedTuple, Sequence

from runtime.engine.planes import PlaneLayout
from runtime.engine.sequence import PLACEHOLDER, Request

BlockKey = Hashable


def chain_digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """128-bit digest of a block's token ids chained to its parent block's digest."""
    data = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.blake2b(parent + data, digest_size=16).digest()


class PrefixPolicy:
    """Names of a request's blocks and how many of its tokens may be cached (engine settings)."""

    def __init__(self, block_size: int, layout: PlaneLayout) -> None:
        self.block_size, self.layout = block_size, layout
        self.num_fixed_planes = layout.num_fixed_planes

    def block_keys(self, request: Request, num_blocks: int) -> list[list[BlockKey]]:
        """Keys `[plane][block]` of the request's first `num_blocks` full blocks (tokens must be known)."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        while len(hashes) < num_blocks:
            j = len(hashes)
            block = tokens[j * bs:(j + 1) * bs]
            assert len(block) == bs and PLACEHOLDER not in block, "only full, known blocks have keys"
            hashes.append(chain_digest(hashes[-1] if hashes else request.cache_salt, block))
        fixed_extra = (request.num_loops, request.exit_threshold, request.params.min_loops)
        return [[(h, p, fixed_extra) if p < self.num_fixed_planes else (h, p) for h in hashes[:num_blocks]]
                for p in range(request.num_planes)]

    def cacheable_len(self, request: Request) -> int:
        """Leading tokens whose KV is final and equal to what a fresh prefill would compute."""
        n = min(request.num_settled_tokens, len(request.prompt_token_ids) + request.num_resolved_outputs)
        if request.exit_threshold < 1.0 and (self.layout.stops_early or self.num_fixed_planes):
            # a decoding token that exited early has copied KV in the planes it skipped (last_exited),
            # and a sampled row's coda KV comes from its exit loop: keep to the plain prompt rows
            n = min(n, len(request.prompt_token_ids) - 1)
        return max(n, 0)

    def max_hit_blocks(self, request: Request) -> int:
        """Full blocks a hit may cover: the last token is always computed, for its logits."""
        return (request.num_tokens - 1) // self.block_size


class PrefixCache:
    """key <-> block for cached blocks, and the LRU order of the unreferenced ones (evictable)."""

    def __init__(self) -> None:
        self.block_of: dict[BlockKey, int] = {}
        self.key_of: dict[int, BlockKey] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()     # oldest release first
        self.num_hits = self.num_queries = 0

    def __len__(self) -> int:
        return len(self.block_of)

    def insert(self, key: BlockKey, block: int) -> bool:
        """Name `block` by `key` unless the key or the block is already named."""
        if key in self.block_of or block in self.key_of:
            return False
        self.block_of[key] = block
        self.key_of[block] = key
        return True

    def evict_oldest(self) -> int:
        """Forget the least recently released unreferenced cached block; returns it (now plain free)."""
        block, _ = self.evictable.popitem(last=False)
        del self.block_of[self.key_of.pop(block)]
        return block


class PrefixHit(NamedTuple):
    tables: list[list[int]]      # [plane][block] cached blocks the request starts with
    num_evictable: int           # of those, blocks nobody references now (they leave the free pool)

    @property
    def num_blocks(self) -> int:
        """Blocks per plane."""
        return len(self.tables[0]) if self.tables else 0


NO_HIT = PrefixHit([], 0)
