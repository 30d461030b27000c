"""Counter-based random numbers on the device: a uniform per (seed, position, token) computed by
hashing, not drawn from a stream.

A seeded request's noise at a position then depends on nothing else: not on the batch it shares,
not on how many numbers other requests drew, not on the device's RNG state, and every row of a
batch gets its own stream without a `torch.Generator` per request. The hash works on 32-bit
values held in int64 tensors, and every multiplication keeps its product below 2**63 (a 32-bit
value times a constant below 2**31), so no backend's integer overflow behaviour matters.
"""
from __future__ import annotations

import math

import torch

_M32 = 0xFFFFFFFF
_MASK63 = (1 << 63) - 1
_STATE_STREAM = 0x2545F491           # keys the initial-state stream apart from the sampler's


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective scramble of 32-bit values (`x`: int64 holding [0, 2**32)): xor-shift and odd
    multiplies, two rounds."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x6D2B79F5) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 13)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from its 63-bit seed and its position (`[R]` int64 each)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    a = mix32(mix32(positions & _M32) ^ lo)
    b = mix32(mix32(a ^ hi) ^ 0x5BD1E995)
    return a, b


def keyed_exponentials(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`[R, V]` float32 Exp(1) noise: row r, column t fixed by (seeds[r], positions[r], t)."""
    a, b = row_keys(seeds, positions)
    tokens = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = mix32(mix32(tokens[None, :] ^ a[:, None]) ^ b[:, None])
    # 24 bits, centred in their interval: u in (0, 1), exact in float32, so -log(u) is finite and > 0
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)


def keyed_truncated_normals(seed: int, positions: torch.Tensor, width: int) -> torch.Tensor:
    """`[N, width]` float32 standard normals truncated at +-3, row i fixed by (seed, positions[i])
    (Huginn's random initial state: a seeded request's state at a position then does not depend on
    how its prompt was chunked, on a recompute, or on the batch). A stream of its own: the sampler's
    noise at the same (seed, position) is not reused. Inverse CDF of a uniform in [Phi(-3), Phi(3)],
    as torch's trunc_normal_ draws."""
    positions = positions.reshape(-1).to(torch.int64)
    a, b = row_keys(torch.full_like(positions, seed & _MASK63), positions)
    columns = torch.arange(width, device=positions.device, dtype=torch.int64)
    bits = mix32(mix32(columns[None, :] ^ a[:, None]) ^ (b[:, None] ^ _STATE_STREAM))
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    low = 0.5 * math.erfc(3 / math.sqrt(2))                      # Phi(-3)
    return math.sqrt(2) * torch.erfinv(2 * (low + u * (1 - 2 * low)) - 1)


def derive_seed(seed: int, index: int) -> int:
    """A seed for sample `index` of a request seeded with `seed` (n > 1): distinct per index,
    fixed by the pair; index 0 keeps the request's own seed."""
    if index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 29)) & _MASK63
