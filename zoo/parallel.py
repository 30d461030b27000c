"""Tensor-parallel layers and the shards of one rank (Megatron-style, through the Hal's `Comm`).

Each attention layer keeps the query heads `[r*H/tp, (r+1)*H/tp)` of rank r and the KV heads they
read: `KVH/tp` of them when tp divides the KV heads, else (tp a multiple of KVH) the one KV head of its
query group, replicated across the ranks that share it. Head counts that tp does not divide are split
by whole KV groups, the first ranks taking one more (see `split_heads`); every rank's KV cache holds
its own heads, so the ranks need not match. The q/k/v and gate/up projections are split
by output rows (column-parallel: no communication), the attention output and down projections by
input columns (row-parallel: one all-reduce each). The embedding and the head are split by vocabulary
rows: a masked lookup plus an all-reduce, and per-rank logits plus an all-gather, so every rank ends
with the same full logits. Norms, Ouro's exit gate and Huginn's adapter stay whole on every rank.

`ShardSpec` says which part of a full checkpoint tensor a rank holds, so loaders read exactly that
slice (`read_shard` over `safe_open(...).get_slice(name)`) and never the whole tensor.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class ShardSpec(NamedTuple):
    """The local tensor = the full tensor's `pieces` (half-open ranges along `dim`) concatenated in
    order, then zero-padded along `dim` to `local_size` (vocabularies that tp does not divide)."""

    dim: int
    pieces: tuple[tuple[int, int], ...]
    full_shape: tuple[int, ...]
    local_size: int


def read_shard(get: Callable[[tuple[slice, ...]], torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """This rank's tensor, from `get(index)` that returns `full[index]` (a tensor, or a safetensors
    slice: only the pieces are read)."""
    lead = (slice(None),) * spec.dim
    parts = [get(lead + (slice(lo, hi),)) for lo, hi in spec.pieces]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)
    missing = spec.local_size - out.shape[spec.dim]
    if missing:
        pad = list(out.shape)
        pad[spec.dim] = missing
        out = torch.cat([out, out.new_zeros(pad)], dim=spec.dim)
    return out


class HeadSplit(NamedTuple):
    num_heads: int          # query heads on this rank
    num_kv_heads: int       # KV heads on this rank (replicated when tp > KVH)
    head_start: int         # first query head of this rank
    kv_head_start: int      # first KV head of this rank


def split_heads(num_heads: int, num_kv_heads: int, rank: int, world_size: int,
                owner: str = "the model") -> HeadSplit:
    """Query and KV heads of `rank`, GQA-aware: each rank takes whole KV groups (a KV head and the
    query heads that read it), as evenly as possible; when tp exceeds the KV heads, tp must be a
    multiple of them (each KV head is replicated on the ranks of its group) and divide the query heads.
    Raises a ValueError naming the head counts and what tp may be."""
    group = num_heads // num_kv_heads                   # query heads per KV head
    if num_kv_heads >= world_size:
        # equal when tp divides the KV heads; else the first ranks take one group more (Huginn's 55
        # heads over 2 ranks: 28 and 27)
        base, extra = divmod(num_kv_heads, world_size)
        kv_count, kv_start = base + (rank < extra), rank * base + min(rank, extra)
        return HeadSplit(kv_count * group, kv_count, kv_start * group, kv_start)
    if world_size % num_kv_heads == 0 and num_heads % world_size == 0:
        count = num_heads // world_size
        start = rank * count
        return HeadSplit(count, 1, start, start // group)   # this rank's query heads lie in one group
    multiples = [t for t in range(num_kv_heads, num_heads + 1, num_kv_heads) if num_heads % t == 0]
    raise ValueError(
        f"cannot split {owner} over tp={world_size} ranks: it has num_attention_heads={num_heads} and "
        f"num_key_value_heads={num_kv_heads}; tp must be at most the KV heads, or a multiple of them that "
        f"divides the query heads. Choose parallel.tp <= {num_kv_heads}, or one of {multiples}")


def even_range(size: int, rank: int, world_size: int, what: str) -> tuple[int, int]:
    if size % world_size:
        raise ValueError(f"cannot split {what}={size} over tp={world_size} ranks evenly; choose a tp that "
                         f"divides {size}")
    n = size // world_size
    return rank * n, (rank + 1) * n


# ----- layers -----------------------------------------------------------------------------------
class RowParallelLinear(nn.Module):
    """`y = all_reduce(x_local @ W[:, cols]^T) + b`: input features split across ranks."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)             # [out, in / tp]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        self.comm.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows `[vocab_start, vocab_end)` of the embedding (zero-padded to equal sizes); tokens outside
    them look up zeros, and the all-reduce adds the one rank's row, so the result is exact."""

    def __init__(self, weight: torch.Tensor, vocab_start: int, vocab_end: int, comm: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)             # [V_local, D]
        self.vocab_start, self.vocab_end, self.comm = vocab_start, vocab_end, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0)
        self.comm.all_reduce(out)
        return out                                                           # [..., D]


class VocabParallelHead(nn.Module):
    """Logits of this rank's vocabulary rows, all-gathered so every rank has the full `[..., V]`."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, world_size: int, comm: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)             # [V_local, D]
        self.vocab_size, self.world_size, self.comm = vocab_size, world_size, comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight)                                     # [..., V_local]
        rows = local.reshape(-1, local.shape[-1])                            # [N, V_local]
        gathered = rows.new_empty(self.world_size * rows.shape[0], rows.shape[1])
        self.comm.all_gather(gathered, rows)                                 # [tp * N, V_local], rank-major
        full = gathered.view(self.world_size, *rows.shape).transpose(0, 1).reshape(rows.shape[0], -1)
        return full[:, :self.vocab_size].reshape(*x.shape[:-1], self.vocab_size)


class TensorParallel(NamedTuple):
    """What `shard` recorded on a model (`model.tensor_parallel`)."""

    rank: int
    world_size: int
    comm: Any
    heads: HeadSplit                          # per attention layer (every layer splits alike)
    specs: dict[str, ShardSpec]               # parameter name -> its slice of the checkpoint tensor


def tensor_parallel(model: nn.Module) -> TensorParallel | None:
    return getattr(model, "tensor_parallel", None)


def rank_heads(model: nn.Module) -> tuple[int, int]:
    """(query heads, KV heads) that this rank's attention layers compute and cache."""
    tp = tensor_parallel(model)
    if tp is not None:
        return tp.heads.num_heads, tp.heads.num_kv_heads
    return model.num_attention_heads, model.kv_spec.num_kv_heads
