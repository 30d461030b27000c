"""The attention checks: paged attention and the KV cache's write, read and copy against the CPU
reference backend, and `Hal.dense` against float64 attention, on fresh random inputs (never zeros)
with GQA, odd head dims, several planes and shuffled block tables.

A module of their own so that `checks.py` keeps to listing and running the checks; the tolerances,
random paged batches and error measure here are shared with `checks.py`, `ops.py` and `quant.py`.
"""
from __future__ import annotations

import random

import torch

from hal.attention import PagedBatch, dense_attention
from hal.base import Hal
from hal.common.torch_attention import TorchPagedAttention

TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
SHAPES = [  # (heads, kv heads, head dim): MHA, GQA, odd head dims
    (4, 4, 16), (8, 2, 24), (6, 3, 40), (4, 1, 64), (16, 8, 128),
]


def _random_batch(rng: random.Random, block_size: int, num_planes: int, num_blocks: int) -> PagedBatch:
    """2-5 sequences mixing prefill (many new tokens), decode (one) and chunked prefill."""
    num_seqs = rng.randint(2, 5)
    seq_lens = [rng.randint(1, 3 * block_size + 5) for _ in range(num_seqs)]
    query_lens = [rng.choice([1, s, rng.randint(1, s)]) for s in seq_lens]
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = []
    for _ in range(num_planes):
        plane = []
        for s in seq_lens:
            n = -(-s // block_size)
            plane.append([pool.pop() for _ in range(n)])
        tables.append(plane)
    return PagedBatch(query_lens, seq_lens, tables, block_size)


def _history_batch(batch: PagedBatch) -> PagedBatch:
    """The same sequences with every token new: writes the whole history in one call."""
    return PagedBatch(list(batch.seq_lens), list(batch.seq_lens), batch.block_tables, batch.block_size)


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float().cpu() - b.float().cpu()).abs().max().item()


def check_paged_attention(hal: Hal) -> None:
    """Paged attention (prefill, decode, chunked prefill; several planes) equals the CPU reference."""
    device = hal.device()
    rng = random.Random(0)
    for dtype in [d for d in (torch.float32, torch.bfloat16) if d in hal.caps.dtypes]:
        for heads, kv_heads, head_dim in SHAPES:
            if hal.caps.head_dims is not None and head_dim not in hal.caps.head_dims:
                pass  # the Hal routes such shapes to its declared fallback; it must still be right
            backend = hal.attention(heads, kv_heads, head_dim, dtype)
            reference = TorchPagedAttention(heads, kv_heads, head_dim, torch.float32, torch.device("cpu"),
                                            backend.block_size)
            num_planes, num_blocks = 2, 64
            batch = _random_batch(rng, backend.block_size, num_planes, num_blocks)
            total = sum(batch.seq_lens)
            keys = torch.randn(total, kv_heads, head_dim, dtype=dtype)
            values = torch.randn(total, kv_heads, head_dim, dtype=dtype)
            q = torch.randn(sum(batch.query_lens), heads, head_dim, dtype=dtype)
            cache = torch.randn(backend.kv_cache_shape(num_blocks), dtype=dtype, device=device)
            ref_cache = torch.zeros(reference.kv_cache_shape(num_blocks))
            hist, ref_hist = backend.build_meta(_history_batch(batch)), reference.build_meta(_history_batch(batch))
            meta, ref_meta = backend.build_meta(batch), reference.build_meta(batch)
            for plane in range(num_planes):
                backend.write_kv(keys.to(device), values.to(device), cache, hist, plane)
                reference.write_kv(keys.float(), values.float(), ref_cache, ref_hist, plane)
                scale = head_dim ** -0.5
                out = backend.forward(q.to(device), cache, meta, plane, scale)
                ref = reference.forward(q.float(), ref_cache, ref_meta, plane, scale)
                assert out.shape == q.shape and out.dtype == dtype, f"output {out.shape} {out.dtype}"
                err = _max_err(out, ref)
                assert err <= TOLERANCE[dtype], (f"{hal.name}/{backend.name} {dtype} H={heads} KVH={kv_heads} "
                                                 f"D={head_dim} plane {plane}: max error {err:.2e}")


def check_kv_round_trip(hal: Hal) -> None:
    """Keys and values written by `write_kv` read back exactly; `copy_kv` moves them between slots."""
    device = hal.device()
    backend = hal.attention(8, 2, 24, torch.bfloat16 if torch.bfloat16 in hal.caps.dtypes else torch.float32)
    rng = random.Random(1)
    batch = _random_batch(rng, backend.block_size, 2, 48)
    total = sum(batch.seq_lens)
    k = torch.randn(total, 2, 24, dtype=backend.dtype, device=device)
    v = torch.randn(total, 2, 24, dtype=backend.dtype, device=device)
    cache = torch.zeros(backend.kv_cache_shape(48), dtype=backend.dtype, device=device)
    hist = _history_batch(batch)
    meta = backend.build_meta(hist)
    from hal.common.paged import slot_mapping

    slots = torch.from_numpy(slot_mapping(hist)).to(device)
    for plane in range(2):
        backend.write_kv(k, v, cache, meta, plane)
        rk, rv = backend.read_kv(cache, slots[plane])
        assert torch.equal(rk, k) and torch.equal(rv, v), f"plane {plane}: read_kv differs from what was written"
    backend.copy_kv(cache, slots[0][:5], slots[1][:5])
    rk, _ = backend.read_kv(cache, slots[1][:5])
    assert torch.equal(rk, k[:5]), "copy_kv did not copy"


def check_dense_attention(hal: Hal) -> None:
    """`Hal.dense` (training path) matches float64 attention, including a bottom-right causal suffix."""
    device = hal.device()
    for dtype in [d for d in (torch.float32, torch.bfloat16) if d in hal.caps.dtypes]:
        q = torch.randn(2, 8, 7, 40, dtype=dtype)
        k = torch.randn(2, 2, 11, 40, dtype=dtype)
        v = torch.randn(2, 2, 11, 40, dtype=dtype)
        out = hal.dense(q.to(device), k.to(device), v.to(device), scale=0.15, causal=True)
        ref = dense_attention(q.double(), k.double(), v.double(), scale=0.15, causal=True)
        assert _max_err(out, ref) <= TOLERANCE[dtype], f"{dtype}: dense error {_max_err(out, ref):.2e}"
