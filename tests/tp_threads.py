"""Tensor-parallel ranks as threads of one process, for fast tests of the sharded math (the real
multi-process path over gloo is tests/runtime/test_tensor_parallel.py)."""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

REDUCE = {"sum": lambda t: t.sum(0), "min": lambda t: t.amin(0), "max": lambda t: t.amax(0)}


class ThreadGroup:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots: list[Any] = [None] * world_size


class ThreadComm:
    """`hal.resources.Comm` between threads: every rank reduces the same stacked tensors in rank order,
    so all ranks get identical results, as NCCL and gloo give."""

    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank, self.world_size = group, rank, group.world_size
        self.num_calls = 0

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.num_calls += 1
        self.group.slots[self.rank] = tensor.detach().clone()
        self.group.barrier.wait()
        parts = list(self.group.slots)
        self.group.barrier.wait()                 # nobody overwrites a slot before all have read
        return parts

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor.copy_(REDUCE[op](torch.stack(self._exchange(tensor))))

    def all_gather(self, out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
        return out.copy_(torch.cat(self._exchange(tensor)))

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return tensor.copy_(self._exchange(tensor)[src])


def run_ranks(world_size: int, fn: Callable[[int, ThreadComm], Any]) -> list[Any]:
    """`fn(rank, comm)` on `world_size` threads; their results in rank order (the first error is raised)."""
    group = ThreadGroup(world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            with torch.inference_mode():
                results[rank] = fn(rank, ThreadComm(group, rank))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results
