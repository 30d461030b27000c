"""Random paged-attention batches for the kernel tests: prefill, chunked prefill and decode mixed,
shuffled blocks, several planes; the cache's unused slots hold NaN so a kernel that reads past a
sequence's keys fails loudly."""
from __future__ import annotations

import random
from typing import NamedTuple

import torch

from hal.attention import PagedBatch
from hal.common.torch_attention import TorchPagedAttention


class PagedCase(NamedTuple):
    step: PagedBatch            # this step: query_lens new tokens per sequence
    history: PagedBatch         # every cached token new: writes the whole history
    keys: torch.Tensor          # [sum(seq_lens), KVH, D] per plane stacked: [P, ...]
    values: torch.Tensor
    q: torch.Tensor             # [sum(query_lens), H, D]
    num_blocks: int


def random_case(rng: random.Random, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                block_size: int = 16, num_planes: int = 2, seq_lens: list[int] | None = None,
                query_lens: list[int] | None = None) -> PagedCase:
    if seq_lens is None:
        seq_lens = [rng.randint(1, 3 * block_size + 7) for _ in range(rng.randint(3, 5))]
    if query_lens is None:   # decode, full prefill and chunked prefill
        query_lens = [[1, s, rng.randint(1, s)][i % 3] for i, s in enumerate(seq_lens)]
    need = sum(-(-s // block_size) for s in seq_lens) * num_planes
    num_blocks = need + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = [[[pool.pop() for _ in range(-(-s // block_size))] for s in seq_lens] for _ in range(num_planes)]
    total = sum(seq_lens)
    keys = torch.randn(num_planes, total, kv_heads, head_dim).to(dtype)
    values = torch.randn(num_planes, total, kv_heads, head_dim).to(dtype)
    q = torch.randn(sum(query_lens), heads, head_dim).to(dtype)
    return PagedCase(PagedBatch(query_lens, seq_lens, tables, block_size),
                     PagedBatch(seq_lens, seq_lens, tables, block_size), keys, values, q, num_blocks)


def run_both(backend, case: PagedCase, plane: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(backend output, CPU reference output in float32) for `case` on `plane`."""
    heads, head_dim = case.q.shape[1:]
    kv_heads = case.keys.shape[2]
    reference = TorchPagedAttention(heads, kv_heads, head_dim, torch.float32, torch.device("cpu"),
                                    case.step.block_size)
    cache = torch.full(backend.kv_cache_shape(case.num_blocks), float("nan"), dtype=case.q.dtype)
    ref_cache = torch.zeros(reference.kv_cache_shape(case.num_blocks))
    history, ref_history = backend.build_meta(case.history), reference.build_meta(case.history)
    for p in range(len(case.step.block_tables)):
        backend.write_kv(case.keys[p], case.values[p], cache, history, p)
        reference.write_kv(case.keys[p].float(), case.values[p].float(), ref_cache, ref_history, p)
    out = backend.forward(case.q, cache, backend.build_meta(case.step), plane, scale)
    ref = reference.forward(case.q.float(), ref_cache, reference.build_meta(case.step), plane, scale)
    return out, ref
