"""Block manager bookkeeping: exact counts, growth, no leaks under random operations."""
import random

import pytest

from runtime.engine.kv_cache import BlockManager
from runtime.engine.planes import PlaneLayout


def test_planes_per_mode():
    assert PlaneLayout("full", 0).num_planes(4) == 4
    assert PlaneLayout("last_exited", 1).num_planes(4) == 5
    assert PlaneLayout("shared", 0).num_planes(4) == 1
    assert PlaneLayout("shared", 1).num_planes(32) == 2
    assert [PlaneLayout("shared", 1).physical(p) for p in range(4)] == [0, 1, 1, 1]
    assert [PlaneLayout("full", 1).physical(p) for p in range(4)] == [0, 1, 2, 3]
    assert list(PlaneLayout("last_exited", 1).skipped_planes(1, 4)) == [3, 4]     # loops 2, 3 after plane 0
    assert not PlaneLayout("full", 0).skipped_planes(0, 4) and not PlaneLayout("shared", 0).skipped_planes(0, 4)
    assert [PlaneLayout(m, 0).stops_early for m in ("full", "last_exited", "shared")] == [False, True, True]
    with pytest.raises(ValueError, match="kv_mode"):
        PlaneLayout("bogus", 0)


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


# ----- prefix caching: reference counts, names per plane, LRU eviction ------------------------
def keys_for(tokens, block_size, num_planes, salt=b"s"):
    from runtime.engine.prefix_cache import chain_digest

    digests, parent = [], salt
    for j in range(len(tokens) // block_size):
        parent = chain_digest(parent, tokens[j * block_size:(j + 1) * block_size])
        digests.append(parent)
    return [[(d, p) for d in digests] for p in range(num_planes)]


def test_prefix_blocks_are_shared_by_reference_and_survive_their_owner():
    rng = random.Random(1)
    bm = BlockManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
    prompt = [rng.randrange(1, 500) for _ in range(10)]            # 2 full blocks + 2 tokens
    bm.allocate("a", num_planes=2, num_tokens=10)
    bm.register("a", keys_for(prompt, 4, 2))
    hit = bm.match_prefix(keys_for(prompt, 4, 2))
    assert hit.num_blocks == 2 and hit.num_evictable == 0
    assert hit.tables == [t[:2] for t in bm.block_tables("a")]
    bm.allocate("b", 2, 11, hit)                                    # shares 2 blocks per plane, adds 1 each
    assert bm.num_free_blocks == 12 - 6 - 2
    assert [bm.ref_counts[b] for b in hit.tables[0]] == [2, 2]
    bm.check_invariants()
    bm.free("a")                                                    # shared blocks stay with b
    assert bm.num_free_blocks == 12 - 6 and all(bm.ref_counts[b] == 1 for t in hit.tables for b in t)
    bm.free("b")                                                    # unreferenced but still cached
    assert bm.num_free_blocks == 12 and len(bm.cache.evictable) == 4
    again = bm.match_prefix(keys_for(prompt, 4, 2))
    assert again.tables == hit.tables and again.num_evictable == 4
    assert bm.num_blocks_needed("c", 2, 9, again) == 2 + 4         # a third block per plane + the 4 revived
    bm.check_invariants()


def test_a_hit_must_cover_every_plane_and_the_chain():
    bm = BlockManager(num_blocks=20, block_size=2, enable_prefix_caching=True)
    tokens = [5, 6, 7, 8, 9, 10]
    bm.allocate("two", 2, 6)
    bm.register("two", keys_for(tokens, 2, 2))
    assert bm.match_prefix(keys_for(tokens, 2, 2)).num_blocks == 3
    assert bm.match_prefix(keys_for(tokens, 2, 3)).num_blocks == 0            # plane 2 never cached
    assert bm.match_prefix(keys_for([5, 6, 0, 8, 9, 10], 2, 2)).num_blocks == 1   # chain breaks at block 1
    assert bm.match_prefix(keys_for(tokens, 2, 2, salt=b"other")).num_blocks == 0


def test_lru_eviction_takes_the_oldest_unreferenced_cached_block():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    for rid, tokens in (("x", [1, 2, 3, 4]), ("y", [7, 8, 9, 10])):
        bm.allocate(rid, 1, 4)
        bm.register(rid, keys_for(tokens, 2, 1))
    x_blocks, y_blocks = bm.block_tables("x")[0], bm.block_tables("y")[0]
    bm.free("x")
    bm.free("y")
    assert len(bm.free_blocks) == 0 and bm.num_free_blocks == 4
    bm.allocate("z", 1, 2)                                   # evicts x's tail block first (released first)
    assert bm.block_tables("z")[0] == [x_blocks[1]]
    assert bm.match_prefix(keys_for([1, 2, 3, 4], 2, 1)).num_blocks == 1      # x's first block still cached
    assert bm.match_prefix(keys_for([7, 8, 9, 10], 2, 1)).tables == [y_blocks]
    bm.check_invariants()


def test_prefix_cache_random_operations_keep_counts_exact():
    rng = random.Random(7)
    bm = BlockManager(num_blocks=60, block_size=4, enable_prefix_caching=True)
    stems = [[rng.randrange(1, 50) for _ in range(16)] for _ in range(3)]
    live = {}
    for step in range(1500):
        if rng.random() < 0.5 or not live:
            rid, planes = f"r{step}", rng.randint(1, 3)
            tokens = rng.choice(stems)[:rng.randint(1, 16)]
            tokens += [rng.randrange(1, 50) for _ in range(rng.randint(0, 6))]
            keys = keys_for(tokens, 4, planes)
            hit = bm.match_prefix([k[:(len(tokens) - 1) // 4] for k in keys])
            if bm.can_allocate(rid, planes, len(tokens), hit=hit):
                bm.allocate(rid, planes, len(tokens), hit)
                bm.register(rid, keys)
                live[rid] = planes
        else:
            bm.free(rng.choice(sorted(live)))
            live = {r: p for r, p in live.items() if r in bm.tables}
        if step % 100 == 0:
            bm.check_invariants()
    for rid in list(live):
        bm.free(rid)
    bm.check_invariants()
    assert bm.num_free_blocks == 60 and bm.cache.num_hits > 100


def test_loop_planes_are_shared_across_loop_counts_but_fixed_planes_are_not():
    from runtime.sampling_params import SamplingParams
    from runtime.engine.prefix_cache import PrefixPolicy
    from runtime.engine.sequence import Request

    policy = PrefixPolicy(block_size=2, layout=PlaneLayout("full", num_fixed_planes=1))     # Huginn-like: 1 fixed plane
    prompt = [random.Random(4).randrange(1, 99) for _ in range(7)]
    two, four = (Request(f"r{n}", prompt, SamplingParams(), num_loops=n, exit_threshold=1.0, num_planes=1 + n,
                         cache_salt=b"s") for n in (2, 4))
    k2, k4 = policy.block_keys(two, 3), policy.block_keys(four, 3)
    assert [len(k) for k in k2] == [3] * 3 and [len(k) for k in k4] == [3] * 5
    assert k2[1:] == k4[1:3]                 # loop planes 0 and 1: the same KV whatever the depth
    assert not set(k2[0]) & set(k4[0])       # the coda's plane depends on how many loops ran
    assert policy.max_hit_blocks(two) == 3 and policy.cacheable_len(two) == 0
