"""Block manager bookkeeping: exact counts, growth, no leaks under random operations."""
import random

import pytest

from runtime.kv_cache import BlockManager, num_request_planes, physical_plane


def test_planes_per_mode():
    assert num_request_planes("full", 0, 4) == 4
    assert num_request_planes("last_exited", 1, 4) == 5
    assert num_request_planes("shared", 0, 4) == 1
    assert num_request_planes("shared", 1, 32) == 2
    assert [physical_plane("shared", 1, p) for p in range(4)] == [0, 1, 1, 1]
    assert [physical_plane("full", 1, p) for p in range(4)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="kv_mode"):
        num_request_planes("bogus", 0, 4)


def test_incremental_growth_and_exact_counts():
    bm = BlockManager(num_blocks=20, block_size=4)
    bm.allocate("a", num_planes=3, num_tokens=5)          # 2 blocks per plane
    assert bm.num_free_blocks == 14 and [len(t) for t in bm.block_tables("a")] == [2, 2, 2]
    bm.allocate("a", 3, 8)                                # still 2 per plane
    assert bm.num_free_blocks == 14
    bm.allocate("a", 3, 9)                                # a third block per plane
    assert bm.num_free_blocks == 11
    assert bm.num_blocks_needed("a", 3, 13) == 3 and bm.num_blocks_needed("b", 2, 1) == 2
    assert not bm.can_allocate("b", 4, 12) and bm.can_allocate("b", 3, 12)
    tables = bm.block_tables("a")
    assert len({b for t in tables for b in t}) == 9       # distinct blocks across planes
    assert bm.free("a") == 9 and bm.num_free_blocks == 20
    with pytest.raises(MemoryError):
        bm.allocate("c", 1, 81)
    assert bm.fits_at_all(4, 20) and not bm.fits_at_all(4, 21)


def test_no_leak_after_thousands_of_random_operations():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=500, block_size=16)
    live: dict[str, tuple[int, int]] = {}
    for step in range(5000):
        op = rng.random()
        if op < 0.4 or not live:
            rid, planes = f"r{step}", rng.randint(1, 5)
            tokens = rng.randint(1, 200)
            if bm.can_allocate(rid, planes, tokens):
                bm.allocate(rid, planes, tokens)
                live[rid] = (planes, tokens)
        elif op < 0.7:
            rid = rng.choice(sorted(live))
            planes, tokens = live[rid]
            tokens += rng.randint(1, 40)
            if bm.can_allocate(rid, planes, tokens):
                bm.allocate(rid, planes, tokens)
                live[rid] = (planes, tokens)
        else:  # finish or abort
            rid = rng.choice(sorted(live))
            planes, tokens = live.pop(rid)
            assert bm.free(rid) == planes * -(-tokens // 16)
        expected_used = sum(p * -(-t // 16) for p, t in live.values())
        assert bm.num_free_blocks == 500 - expected_used
        if step % 500 == 0:
            bm.check_invariants()
    for rid in list(live):
        bm.free(rid)
    bm.check_invariants()
    assert bm.num_free_blocks == 500
