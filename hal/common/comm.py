"""`Comm` over torch.distributed: the same code drives nccl, rccl (as nccl), hccl and gloo."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT}


def _reduce_op(op: str) -> Any:
    try:
        return _OPS[op]
    except KeyError:
        raise ValueError(f"unknown reduce op {op!r}; choose one of {sorted(_OPS)}") from None


class TorchDistComm:
    """Collectives over one process group. Without an initialised group the world is this one
    process and every op is the identity, so single-device code needs no special case."""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.initialized = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.initialized else 0
        self.world_size = dist.get_world_size(group) if self.initialized else 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.initialized:
            # gloo has no AVG: sum, then divide
            if op == "avg" and dist.get_backend(self.group) == "gloo":
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
                tensor.div_(self.world_size)
            else:
                dist.all_reduce(tensor, op=_reduce_op(op), group=self.group)
        return tensor

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        """`out: [world * n, ...]` receives every rank's `tensor: [n, ...]` in rank order."""
        if not self.initialized:
            return out.copy_(tensor)
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)   # renamed in torch 2.13
        gather(out, tensor.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """`tensor: [world * n, ...]` is reduced across ranks; rank r keeps slice r in `out: [n, ...]`."""
        if not self.initialized:
            return out.copy_(tensor)
        if dist.get_backend(self.group) == "gloo":
            # gloo lacks reduce_scatter_tensor: reduce everything, keep this rank's slice
            full = tensor.clone()
            self.all_reduce(full, op)
            return out.copy_(full.chunk(self.world_size)[self.rank])
        dist.reduce_scatter_tensor(out, tensor.contiguous(), op=_reduce_op(op), group=self.group)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.initialized:
            dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        if self.world_size == 1:
            raise RuntimeError("send needs a peer: the process group has one rank")
        dist.send(tensor, dst=dst, group=self.group)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        if self.world_size == 1:
            raise RuntimeError("recv needs a peer: the process group has one rank")
        dist.recv(tensor, src=src, group=self.group)
        return tensor

    def barrier(self) -> None:
        if self.initialized:
            dist.barrier(group=self.group)
