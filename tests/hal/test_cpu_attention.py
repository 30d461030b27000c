"""The CPU reference paged attention equals attention computed directly from the unpaged K/V."""
import math
import random

import torch

from hal.attention import PagedBatch
from hal.common.torch_attention import TorchPagedAttention
from hal.common.paged import slot_mapping, token_positions


def naive(q, k, v, q_pos, scale):
    """q: [Q, H, D] at positions q_pos; k, v: [L, KVH, D] of the whole sequence."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = torch.empty_like(q)
    for i, p in enumerate(q_pos):
        scores = torch.einsum("hd,lhd->hl", q[i], k[: p + 1]) * scale
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v[: p + 1])
    return out


def test_matches_naive_attention_with_shuffled_blocks():
    rng = random.Random(3)
    heads, kv_heads, dim, bs = 6, 2, 20, 4
    backend = TorchPagedAttention(heads, kv_heads, dim, torch.float64, torch.device("cpu"), bs)
    seq_lens, query_lens = [9, 1, 13], [9, 1, 4]
    free = list(range(20))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(math.ceil(s / bs))] for s in seq_lens]
    full = PagedBatch(seq_lens, seq_lens, [tables], bs)
    step = PagedBatch(query_lens, seq_lens, [tables], bs)
    ks = [torch.randn(s, kv_heads, dim, dtype=torch.float64) for s in seq_lens]
    vs = [torch.randn(s, kv_heads, dim, dtype=torch.float64) for s in seq_lens]
    cache = torch.full(backend.kv_cache_shape(20), float("nan"), dtype=torch.float64)
    backend.write_kv(torch.cat(ks), torch.cat(vs), cache, backend.build_meta(full), 0)
    q = torch.randn(sum(query_lens), heads, dim, dtype=torch.float64)
    out = backend.forward(q, cache, backend.build_meta(step), 0, 0.3)
    positions = token_positions(step)
    lo = 0
    for i, n in enumerate(query_lens):
        ref = naive(q[lo:lo + n], ks[i], vs[i], positions[lo:lo + n], 0.3)
        torch.testing.assert_close(out[lo:lo + n], ref)
        lo += n


def test_slot_mapping_skips_planes_a_sequence_does_not_use():
    batch = PagedBatch([2, 1], [2, 5], [[[3], [0, 1]], [[4], []]], 4)
    assert slot_mapping(batch).tolist() == [[12, 13, 4], [16, 17, -1]]
