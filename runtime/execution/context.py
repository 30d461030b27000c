"""The runtime's `ForwardContext`: attention over the paged KV cache through the Hal's backend.

One context serves one step: its metadata (query offsets, lengths, block tables, slot mappings of
every plane) is built once and shared by all loops and layers. `subset` gives a context over some
of the step's sequences (those still looping when others have stopped) with its own metadata.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from hal.base import AttentionBackend, PagedBatch
from runtime.engine.kv_cache import physical_plane


class PagedContext:
    def __init__(self, backend: AttentionBackend, kv_caches: Sequence[torch.Tensor], batch: PagedBatch,
                 positions: torch.Tensor, kv_mode: str, num_fixed_planes: int,
                 initial_state: Callable[[torch.Tensor], torch.Tensor] | None = None, meta: Any = None) -> None:
        self.backend, self.kv_caches, self.batch = backend, kv_caches, batch
        self.positions = positions                       # [1, T]
        self.kv_mode, self.num_fixed_planes = kv_mode, num_fixed_planes
        self.meta = backend.build_meta(batch) if meta is None else meta
        if initial_state is not None:
            self.initial_state = initial_state          # Huginn: per-request random initial states
        self._cache: dict[Any, Any] = {}
        self._subsets: dict[tuple[int, ...], tuple["PagedContext", torch.Tensor]] = {}

    def clear_cached(self) -> None:
        """Forget per-pass values (a graph's eager replay recomputes them from new positions)."""
        self._cache.clear()

    def cached(self, key: Any, fn: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plane: int, layer: int,
               scale: float) -> torch.Tensor:
        # q: [1, T, H, D]; k, v: [1, T, KVH, D] (packed tokens, batch dim 1)
        p = physical_plane(self.kv_mode, self.num_fixed_planes, plane)
        cache = self.kv_caches[layer]
        return self.backend.attend(q[0], k[0], v[0], cache, self.meta, p, scale)[None]

    def attend_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plane: int, layer: int, scale: float,
                      theta: float, interleaved: bool) -> torch.Tensor:
        """`attend` of q and k rotated at this step's positions: the rotation and the KV write in one
        kernel where the backend has it (`write_kv_rotary`; bit for bit the separate ops). Batches
        that attend over their fresh K/V (prefill without context) rotate first: they need k itself."""
        from zoo.layers import rotate

        fused = getattr(self.backend, "write_kv_rotary", None)
        if fused is not None and getattr(self.meta, "fresh_lens", None) is None:
            p = physical_plane(self.kv_mode, self.num_fixed_planes, plane)
            cache = self.kv_caches[layer]
            q_rot = fused(q[0], k[0], v[0], cache, self.meta, p, self.positions.flatten(), theta, interleaved)
            if q_rot is not None:
                return self.backend.forward(q_rot, cache, self.meta, p, scale)[None]
        q, k = rotate(q, k, self, q.shape[-1], theta, interleaved)
        return self.attend(q, k, v, plane, layer, scale)

    def token_rows(self, seqs: Sequence[int]) -> torch.Tensor:
        """Packed token rows of the given sequences, `[T_sub]` int64."""
        starts = [0]
        for n in self.batch.query_lens:
            starts.append(starts[-1] + n)
        rows = [r for i in seqs for r in range(starts[i], starts[i + 1])]
        return torch.tensor(rows, dtype=torch.long, device=self.positions.device)

    def subset(self, seqs: Sequence[int]) -> tuple["PagedContext", torch.Tensor]:
        """A context over sequences `seqs` of this step, and their token rows in this context."""
        key = tuple(seqs)
        if key not in self._subsets:
            rows = self.token_rows(seqs)
            b = self.batch
            sub_batch = PagedBatch([b.query_lens[i] for i in seqs], [b.seq_lens[i] for i in seqs],
                                   [[plane[i] for i in seqs] for plane in b.block_tables], b.block_size)
            sub = PagedContext(self.backend, self.kv_caches, sub_batch, self.positions[:, rows], self.kv_mode,
                               self.num_fixed_planes, getattr(self, "initial_state", None))
            self._subsets[key] = (sub, rows)
        return self._subsets[key]
