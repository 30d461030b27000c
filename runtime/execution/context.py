"""The runtime's `ForwardContext`: attention over the paged KV cache through the Hal's backend.

One context serves one pass: its metadata (query offsets, lengths, block tables, slot mappings of
every plane) is built once and shared by all loops and layers. `subset` gives a context over some
of the pass's sequences (those still looping when others have stopped) with its own metadata.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

from hal.attention import PagedBatch
from zoo.context import BaseContext

if TYPE_CHECKING:
    from runtime.execution.step_inputs import PassEnv
    from zoo.base import LoopedCausalLM


class PagedContext(BaseContext):
    def __init__(self, env: "PassEnv", batch: PagedBatch, positions: torch.Tensor,
                 draws: Sequence[tuple[Any, int]], meta: Any = None,
                 static_initial_state: torch.Tensor | None = None) -> None:
        super().__init__()
        self.env, self.batch = env, batch
        self.ops = env.ops
        self.positions = positions                        # [1, T]
        self.draws = draws                                # (request, rows) per sequence
        self.meta = env.backend.build_meta(batch) if meta is None else meta
        self.static_initial_state = static_initial_state  # a captured pass: drawn before each replay
        self._subsets: dict[tuple[int, ...], tuple["PagedContext", torch.Tensor]] = {}

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plane: int, layer: int,
               scale: float) -> torch.Tensor:
        # q: [1, T, H, D]; k, v: [1, T, KVH, D] (packed tokens, batch dim 1)
        env = self.env
        p = env.layout.physical(plane)
        return env.backend.attend(q[0], k[0], v[0], env.kv_caches[layer], self.meta, p, scale)[None]

    def attend_rotary(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plane: int, layer: int, scale: float,
                      theta: float, interleaved: bool) -> torch.Tensor:
        """`attend` of q and k rotated at this pass's positions: the rotation in the KV write's
        kernel where the backend has it (`AttentionBackend.attend_rotary`; bit for bit the separate
        ops), else rotary then `attend`."""
        env = self.env
        out = env.backend.attend_rotary(q[0], k[0], v[0], env.kv_caches[layer], self.meta, env.layout.physical(plane),
                                        self.positions.flatten(), theta, interleaved, scale)
        if out is not None:
            return out[None]
        return super().attend_rotary(q, k, v, plane, layer, scale, theta, interleaved)

    def initial_state(self, model: "LoopedCausalLM", e: torch.Tensor) -> torch.Tensor:
        """Huginn: each request's own draw (or, in a captured pass, the buffer drawn before replay)."""
        if self.static_initial_state is not None:
            return self.static_initial_state
        from runtime.execution.step_inputs import draw_initial_states

        return draw_initial_states(model, self.draws, e.dtype, e.device, self.positions)

    def advanced(self, steps: int) -> "PagedContext":
        """This decode pass (one token per sequence) `steps` positions on, its metadata advanced on
        the device (`AttentionBackend.advance_meta`): speculation chains its draft passes this way
        inside one graph. The host batch and draws stay this pass's (not for eager subsets or Huginn)."""
        meta = self.env.backend.advance_meta(self.meta, steps)
        if meta is None:
            raise ValueError(f"attention backend {self.env.backend.name!r} cannot advance metadata on the device")
        return PagedContext(self.env, self.batch, self.positions + steps, self.draws, meta=meta)

    def token_rows(self, seqs: Sequence[int]) -> torch.Tensor:
        """Packed token rows of the given sequences, `[T_sub]` int64."""
        starts = [0]
        for n in self.batch.query_lens:
            starts.append(starts[-1] + n)
        rows = [r for i in seqs for r in range(starts[i], starts[i + 1])]
        return torch.tensor(rows, dtype=torch.long, device=self.positions.device)

    def subset(self, seqs: Sequence[int]) -> tuple["PagedContext", torch.Tensor]:
        """A context over sequences `seqs` of this pass, and their token rows in this context."""
        key = tuple(seqs)
        if key not in self._subsets:
            rows = self.token_rows(seqs)
            b = self.batch
            sub_batch = PagedBatch([b.query_lens[i] for i in seqs], [b.seq_lens[i] for i in seqs],
                                   [[plane[i] for i in seqs] for plane in b.block_tables], b.block_size)
            sub = PagedContext(self.env, sub_batch, self.positions[:, rows], [self.draws[i] for i in seqs])
            self._subsets[key] = (sub, rows)
        return self._subsets[key]
