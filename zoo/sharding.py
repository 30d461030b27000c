"""`shard(model, rank, world_size, comm)`: turn a built zoo model into rank `rank`'s tensor-parallel part.

Works on a model built on the meta device (then only shapes change: the loaders fill the shards
from the checkpoint or from seeded random draws) and on a materialised one (the weights are sliced).
The model files stay plain `nn.Module`s for training; sharding is a transform applied afterwards, by
module type. Attention modules keep reading their head counts from `num_heads` / `num_kv_heads`,
which are set to the per-rank counts here. See `zoo.parallel` for the layout.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from zoo.huginn.blocks import GatedMLP, HuginnAttention
from zoo.layers import GQAttention, SwiGLU
from zoo.loading import SkipMetaInit
from zoo.parallel import (HeadSplit, RowParallelLinear, ShardSpec, TensorParallel, VocabParallelEmbedding,
                          VocabParallelHead, even_range, read_shard, split_heads)

log = logging.getLogger(__name__)
Specs = dict[str, ShardSpec]


class _Sharder:
    def __init__(self, owner: str, rank: int, world_size: int, comm: Any) -> None:
        self.owner, self.rank, self.world_size, self.comm = owner, rank, world_size, comm
        self.heads: HeadSplit | None = None

    def split(self, num_heads: int, num_kv_heads: int) -> HeadSplit:
        split = split_heads(num_heads, num_kv_heads, self.rank, self.world_size, self.owner)
        if self.heads not in (None, split):
            raise ValueError(f"{self.owner}: attention layers with different head counts cannot share one "
                             f"KV cache")
        if self.heads is None and num_heads % self.world_size:
            log.info("%s: %d query heads over %d ranks: rank %d computes %d (uneven split by KV group)",
                     self.owner, num_heads, self.world_size, self.rank, split.num_heads)
        self.heads = split
        return split

    def column(self, linear: nn.Linear, pieces: list[tuple[int, int]], specs: Specs, name: str) -> nn.Linear:
        """A linear keeping the output rows `pieces` (no communication)."""
        weight = _take(linear.weight, 0, pieces, specs, f"{name}.weight")
        bias = None if linear.bias is None else _take(linear.bias, 0, pieces, specs, f"{name}.bias")
        with SkipMetaInit():                                   # a shell: its weights are set below
            out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        out.weight = nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            out.bias = nn.Parameter(bias, requires_grad=False)
        return out

    def row(self, linear: nn.Linear, pieces: list[tuple[int, int]], specs: Specs,
            name: str) -> RowParallelLinear:
        """A linear keeping the input columns `pieces`; its outputs are all-reduced."""
        weight = _take(linear.weight, 1, pieces, specs, f"{name}.weight")
        bias = None if linear.bias is None else linear.bias.detach()
        return RowParallelLinear(weight, bias, self.comm)

    def vocab_rows(self, vocab_size: int) -> tuple[int, int, int]:
        """(start, end, local rows): ceil(V / tp) rows per rank, the last ones zero-padded."""
        per_rank = -(-vocab_size // self.world_size)
        start = min(self.rank * per_rank, vocab_size)
        return start, min(vocab_size, start + per_rank), per_rank


def _take(param: torch.Tensor, dim: int, pieces: list[tuple[int, int]], specs: Specs, name: str,
          local_size: int | None = None) -> torch.Tensor:
    spec = ShardSpec(dim, tuple(pieces), tuple(param.shape), local_size or sum(hi - lo for lo, hi in pieces))
    specs[name] = spec
    if param.is_meta:                  # a shape only (the loaders fill it); meta torch.cat is slow to import
        return param.new_empty(param.shape[:dim] + (spec.local_size,) + param.shape[dim + 1:])
    return read_shard(lambda index: param.detach()[index], spec).clone()   # a copy: the full tensor can go


def _head_rows(start: int, count: int, head_dim: int, offset: int = 0) -> tuple[int, int]:
    return offset + start * head_dim, offset + (start + count) * head_dim


# ----- per module type: shard in place, record the specs under the module's name --------------
def _gq_attention(s: _Sharder, m: GQAttention, specs: Specs, name: str) -> None:
    split = s.split(m.num_heads, m.num_kv_heads)
    q = [_head_rows(split.head_start, split.num_heads, m.head_dim)]
    kv = [_head_rows(split.kv_head_start, split.num_kv_heads, m.head_dim)]
    m.q_proj = s.column(m.q_proj, q, specs, f"{name}.q_proj")
    m.k_proj = s.column(m.k_proj, kv, specs, f"{name}.k_proj")
    m.v_proj = s.column(m.v_proj, kv, specs, f"{name}.v_proj")
    m.o_proj = s.row(m.o_proj, q, specs, f"{name}.o_proj")
    m.num_heads, m.num_kv_heads = split.num_heads, split.num_kv_heads


def _huginn_attention(s: _Sharder, m: HuginnAttention, specs: Specs, name: str) -> None:
    split = s.split(m.num_heads, m.num_kv_heads)
    d, q_width, kv_width = m.head_dim, m.split[0], m.split[1]
    q = _head_rows(split.head_start, split.num_heads, d)
    k = _head_rows(split.kv_head_start, split.num_kv_heads, d, offset=q_width)
    v = _head_rows(split.kv_head_start, split.num_kv_heads, d, offset=q_width + kv_width)
    m.Wqkv = s.column(m.Wqkv, [q, k, v], specs, f"{name}.Wqkv")              # rows q | k | v, each sliced
    if m.qk_bias is not None:                      # [q|k, 1, H, D]: one row per query head (KVH == H)
        bias = _take(m.qk_bias, 2, [(split.head_start, split.head_start + split.num_heads)], specs,
                     f"{name}.qk_bias")
        m.qk_bias = nn.Parameter(bias, requires_grad=False)
    m.proj = s.row(m.proj, [q], specs, f"{name}.proj")
    m.split = (split.num_heads * d, split.num_kv_heads * d, split.num_kv_heads * d)
    m.num_heads, m.num_kv_heads = split.num_heads, split.num_kv_heads


def _swiglu(s: _Sharder, m: SwiGLU, specs: Specs, name: str) -> None:
    rows = [even_range(m.gate_proj.out_features, s.rank, s.world_size, f"{s.owner} intermediate_size")]
    m.gate_proj = s.column(m.gate_proj, rows, specs, f"{name}.gate_proj")
    m.up_proj = s.column(m.up_proj, rows, specs, f"{name}.up_proj")
    m.down_proj = s.row(m.down_proj, rows, specs, f"{name}.down_proj")


def _gated_mlp(s: _Sharder, m: GatedMLP, specs: Specs, name: str) -> None:
    size = m.proj.in_features                       # fc rows: gate | up, each `size` long
    lo, hi = even_range(size, s.rank, s.world_size, f"{s.owner} intermediate_size")
    m.fc = s.column(m.fc, [(lo, hi), (size + lo, size + hi)], specs, f"{name}.fc")
    m.proj = s.row(m.proj, [(lo, hi)], specs, f"{name}.proj")


HANDLERS: dict[type, Callable[[_Sharder, Any, Specs, str], None]] = {
    GQAttention: _gq_attention,
    HuginnAttention: _huginn_attention,
    SwiGLU: _swiglu,
    GatedMLP: _gated_mlp,
}


def _vocab(s: _Sharder, model: nn.Module, specs: Specs) -> None:
    """Every embedding and the `lm_head` by vocabulary rows; a head tied to an embedding stays tied."""
    sharded: dict[int, tuple[nn.Parameter, ShardSpec]] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Embedding):
            vocab = module.num_embeddings
            lo, hi, rows = s.vocab_rows(vocab)
            weight = _take(module.weight, 0, [(lo, hi)], specs, f"{name}.weight", rows)
            new = VocabParallelEmbedding(weight, lo, hi, s.comm)
            sharded[id(module.weight)] = (new.weight, specs[f"{name}.weight"])
            _set_module(model, name, new)
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        return
    if head.bias is not None:
        raise ValueError(f"{s.owner}: a vocab-parallel head with a bias is not implemented")
    vocab = head.out_features
    lo, hi, rows = s.vocab_rows(vocab)
    tied = sharded.get(id(head.weight))
    if tied is not None:
        new = VocabParallelHead(tied[0].detach(), vocab, s.world_size, s.comm)
        new.weight = tied[0]
        specs["lm_head.weight"] = tied[1]
    else:
        new = VocabParallelHead(_take(head.weight, 0, [(lo, hi)], specs, "lm_head.weight", rows), vocab,
                                s.world_size, s.comm)
    model.lm_head = new


def _set_module(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, module)


def shard(model: nn.Module, rank: int, world_size: int, comm: Any) -> nn.Module:
    """Make `model` rank `rank`'s part of a `world_size`-way tensor-parallel model, in place.

    `comm` (a `hal.resources.Comm`, e.g. `Hal.comm()`) carries the all-reduces and all-gathers. Records
    `model.tensor_parallel` (`zoo.parallel.TensorParallel`). Raises a ValueError naming the head
    counts (or intermediate size) when they cannot split (`zoo.parallel.split_heads`), and for
    attention modules it does not know.
    The result is for inference: the collectives are not differentiable.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"tp rank {rank} is outside 0..{world_size - 1}")
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError(f"{type(model).__name__} is already sharded")
    sharder = _Sharder(type(model).__name__, rank, world_size, comm)
    specs: Specs = {}
    # fused q|k|v and gate|up matrices (zoo.fuse) hold every rank's rows: drop them, re-fuse the shards
    was_fused = _unfuse(model)
    for name, module in list(model.named_modules()):
        handler = HANDLERS.get(type(module))
        if handler is not None:
            handler(sharder, module, specs, name)
        elif hasattr(module, "num_heads") and hasattr(module, "num_kv_heads"):
            raise ValueError(f"{name} ({type(module).__name__}) is an attention module zoo.sharding does not "
                             f"know how to split; add a handler to zoo.sharding.HANDLERS")
    if sharder.heads is None:
        raise ValueError(f"{sharder.owner} has no attention layers zoo.sharding knows")
    _vocab(sharder, model, specs)
    for alias, source in getattr(model, "tied_weights", {}).items():
        if source in specs:
            specs[alias] = specs[source]
    model.tensor_parallel = TensorParallel(rank, world_size, comm, sharder.heads, specs)
    if was_fused:
        from zoo.fuse import fuse_projections

        fuse_projections(model)
    return model


def _unfuse(model: nn.Module) -> bool:
    was_fused = False
    for module in model.modules():
        if isinstance(module, GQAttention) and module.qkv is not None:
            module.qkv, was_fused = None, True
        elif isinstance(module, SwiGLU) and module.gate_up is not None:
            module.gate_up, was_fused = None, True
    return was_fused
