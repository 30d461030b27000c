"""The scheduler's queues and the blocks their requests hold between steps. Pure Python.

A request is waiting (ordered by (priority, arrival) under the priority policy, else by arrival),
running, or swapped out (waiting, with its KV on the host). This module holds those queues and every
change made to them outside a step: a request arrives (`add`, refused when it could never fit the
cache), an n > 1 sample forks from its parent's prompt blocks (`fork`), a request ends (`finish`), its
settled blocks are offered to the prefix cache (`cache_blocks`). The step's decisions (budget,
admission, preemption, wavefront) are `Scheduler`'s, in runtime/engine/scheduler.py, which inherits
these queues.
"""
from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from runtime.engine.kv_cache import BlockManager
from runtime.engine.prefix_cache import PrefixPolicy
from runtime.engine.sequence import Request, RequestStatus

if TYPE_CHECKING:
    from runtime.engine.scheduler import SchedulerConfig


class RequestQueues:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 prefix: PrefixPolicy | None = None) -> None:
        self.config = config
        self.blocks = block_manager
        self.prefix = prefix if block_manager.cache is not None else None
        self.waiting: list[Request] = []         # ordered by _key
        self.running: list[Request] = []
        self.swapped: dict[str, int] = {}        # request id -> blocks per plane held on the host
        self.num_swapped_blocks = 0
        self._num_arrived = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _key(self, request: Request) -> tuple[int, int]:
        return (request.priority if self.config.policy == "priority" else 0, request.arrival_seq)

    def add(self, request: Request) -> None:
        """Queue a new request. Raises MemoryError when it could not finish even with the whole KV
        cache to itself: its prompt plus max_tokens (within its context) must fit, so an admitted
        request is never preempted forever for lack of room."""
        total = self.max_request_tokens(request)
        if not self.blocks.fits_at_all(request.num_planes, total):
            per_plane = self.blocks.num_blocks // request.num_planes * self.blocks.block_size
            raise MemoryError(
                f"request {request.request_id} needs {total} tokens of KV (a prompt of "
                f"{len(request.prompt_token_ids)} + max_tokens {request.params.max_tokens}) in each of its "
                f"{request.num_planes} KV planes, {request.num_planes} x {self.blocks.blocks_per_plane(total)} "
                f"blocks, more than the whole cache ({self.blocks.num_blocks} blocks of {self.blocks.block_size} "
                f"tokens, at most {per_plane} tokens per plane): lower max_tokens, shorten the prompt, use fewer "
                f"loops or kv_mode=shared, or give the KV cache more memory (engine.num_kv_blocks, "
                f"engine.gpu_memory_utilization)")
        request.arrival_seq = self._num_arrived
        self._num_arrived += 1
        bisect.insort(self.waiting, request, key=self._key)

    @staticmethod
    def max_request_tokens(request: Request) -> int:
        """The most tokens whose KV the request can hold: prompt + max_tokens within its context, less
        the last sampled token (it ends the request and is never computed)."""
        return min(len(request.prompt_token_ids) + request.params.max_tokens, request.max_seq_len) - 1

    def fork(self, parent: Request, child: Request, share: bool = True) -> None:
        """Queue `child`, another sample of `parent`'s prompt (n > 1), starting from the parent's
        full prompt blocks (shared, reference counted); it computes the rest of the prompt itself
        (less than a block) and samples from its own logits. It waits at the parent's place in the
        queue. Until admitted it holds those blocks; under pressure they are released
        (`_release_waiting`) and it prefills from scratch. `share=False`: the prompt's KV depends on
        more than its tokens (Huginn's random initial state), so the child computes all of it."""
        bs = self.blocks.block_size
        wanted = (len(parent.prompt_token_ids) - 1) // bs if share else 0
        shared = self.blocks.fork(parent.request_id, child.request_id, wanted) \
            if parent.num_settled_tokens >= wanted * bs else 0
        child.num_computed_tokens = shared * bs
        child.metrics.num_cached_tokens = shared * bs
        child.arrival_seq = parent.arrival_seq
        bisect.insort(self.waiting, child, key=self._key)

    def _release_waiting(self, keep: Request | None = None) -> bool:
        """Drop the blocks that waiting requests hold (forked samples not yet admitted); they will
        prefill from scratch. Returns whether anything was released."""
        released = False
        for request in self.waiting:
            if request is not keep and request.request_id in self.blocks.tables \
                    and request.request_id not in self.swapped:
                self.blocks.free(request.request_id)
                request.num_computed_tokens = 0
                released = True
        return released

    def cache_blocks(self, request: Request) -> None:
        """Offer the request's settled full blocks to the prefix cache."""
        if self.prefix is None or request.cache_salt is None or request.request_id not in self.blocks.tables:
            return
        num_blocks = self.prefix.cacheable_len(request) // self.blocks.block_size
        if num_blocks > self.blocks.num_registered.get(request.request_id, 0):
            self.blocks.register(request.request_id, self.prefix.block_keys(request, num_blocks))

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and free its blocks (running, waiting or swapped)."""
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.num_swapped_blocks -= self.swapped.pop(request.request_id, 0) * request.num_planes
        self.blocks.free(request.request_id)
