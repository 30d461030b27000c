"""The other tensor-parallel ranks: a `Follower` replays rank 0's step plans (runtime/parallel/step_plan.py).

A follower mirrors just enough of each request to make the same `ModelRunner.execute`,
`Speculator.run` and `SwapSpace` calls as the driver's engine: same batch, same block ids, its own
heads' cache. It stands in for the block manager where the runner and the speculator read tables.

Sampling stays identical on all ranks: the head's all-gather gives every rank the same logits, and
each request's generator is seeded the same everywhere (the driver gives unseeded requests a seed),
so Huginn's random initial states and sampled tokens agree. Followers sample too, and check their
token against the one rank 0 sends in the next plan (`TensorParallelMismatch`).
"""
from __future__ import annotations

from typing import Any

from hal.base import Hal
from runtime.execution.sampler import make_generator
from runtime.engine.step_schedule import ScheduledRequest
from runtime.engine.sequence import Request
from runtime.parallel.step_plan import CloseEngine, OpenEngine, StepPlan, StopFollowing


class TensorParallelMismatch(RuntimeError):
    """Ranks of one tensor-parallel run disagree (their logits differ)."""


class Follower:
    """A non-driver rank: builds a runner when the driver opens an engine and executes its plans."""

    def __init__(self, model: Any, hal: Hal, channel: Any) -> None:
        self.model, self.hal, self.channel = model, hal, channel
        self.runner: Any = None
        self.swap: Any = None
        self.speculator: Any = None
        self.requests: dict[str, Request] = {}
        self.tables: dict[str, list[list[int]]] = {}
        self.changed: set[str] = set()                    # requests whose tables changed (the runner's rows)
        self.sampled: dict[str, list[int]] = {}           # our last step's tokens per request, to check
        self.num_steps = 0
        self.num_checked_tokens = 0                       # ours that equalled rank 0's

    def run(self) -> None:
        """Handle messages until the driver sends `StopFollowing`."""
        while self.handle(self.channel.recv()):
            pass

    def handle(self, message: Any) -> bool:
        """Act on one message; False after `StopFollowing`."""
        if isinstance(message, StepPlan):
            self.step(message)
        elif isinstance(message, OpenEngine):
            from runtime.execution.runner import ModelRunner
            from runtime.speculation.speculator import Speculator
            from runtime.engine.swap import SwapSpace

            self._release()
            self.runner = ModelRunner(self.model, self.hal, message.config, message.max_model_len,
                                      message.max_loops)
            self.swap = SwapSpace(self.hal, self.runner.backend, self.runner.kv_caches)
            spec = message.config.speculative
            self.speculator = Speculator(self.runner, spec) if spec.is_enabled else None
        elif isinstance(message, CloseEngine):
            self._release()
            self.hal.empty_cache()
        elif isinstance(message, StopFollowing):
            self._release()
            return False
        else:
            raise TypeError(f"unknown control message {message!r}")
        return True

    def _release(self) -> None:
        self.runner = self.swap = self.speculator = None
        self.requests, self.tables, self.sampled, self.changed = {}, {}, {}, set()

    # ----- the block manager as the runner and the speculator see it ----------------------
    def block_tables(self, request_id: str) -> list[list[int]]:
        return self.tables[request_id]

    def trim(self, request_id: str, num_tokens: int) -> int:
        """As `BlockManager.trim` after a speculation round (the driver frees the blocks; its next
        plan sends the trimmed tables whole)."""
        keep = -(-num_tokens // self.runner.block_size)
        tables = self.tables.get(request_id, [])
        dropped = sum(max(0, len(table) - keep) for table in tables)
        self.changed.add(request_id)
        for table in tables:
            del table[keep:]
        return dropped

    def step(self, plan: StepPlan) -> None:
        for rid in plan.finished:                   # as the engine's `_finish`
            self.requests.pop(rid, None)
            self.tables.pop(rid, None)
            self.changed.add(rid)
            self.sampled.pop(rid, None)
            self.swap.drop(rid)
            self.runner.forget(rid)
        for rid in plan.forget:                     # as the engine's `_move_preempted`
            self.runner.forget(rid)
        for rid, blocks in plan.swap_out:
            self.swap.swap_out(rid, blocks)
        for rid, blocks in plan.swap_in:
            self.swap.swap_in(rid, blocks)
        if not plan.items:
            return
        for new in plan.new_requests:
            self.requests[new.request_id] = Request(
                new.request_id, list(new.prompt_token_ids), new.params, new.num_loops, new.exit_threshold,
                new.num_planes, stop_token_ids=new.stop_token_ids,
                generator=make_generator(new.params, self.runner.device))
        plain, drafting = [], []
        for item in plan.items:
            request = self.requests[item.request_id]
            if item.new_token_ids:
                self._check(item.request_id, item.new_token_ids)
                request.output_token_ids.extend(item.new_token_ids)
            request.num_computed_tokens = item.num_computed_tokens
            if item.reset_tables or item.tables is not None:
                self.changed.add(item.request_id)
            if item.reset_tables:
                self.tables[item.request_id] = [list(t) for t in item.tables]
            elif item.tables is not None:
                for table, added in zip(self.tables[item.request_id], item.tables):
                    table.extend(added)
            scheduled = ScheduledRequest(request, item.num_tokens, item.start, item.depth, item.is_wave,
                                         item.num_draft_tokens)
            (drafting if item.num_draft_tokens else plain).append(scheduled)
        # as the engine's `_launch`: plain items first, then the speculation round (same collectives)
        if plain:
            for rid, (token, _) in self.runner.execute(plain, self).sampled.items():
                self.sampled[rid] = [token]
        if drafting:
            self.sampled.update(self.speculator.run(drafting, self).committed)
        self.num_steps += 1

    def _check(self, rid: str, tokens: tuple[int, ...]) -> None:
        """Our tokens of the request's last step against rank 0's (which a stop token may cut short)."""
        ours = self.sampled.pop(rid, None)
        if ours is not None and list(tokens[:len(ours)]) != ours[:len(tokens)]:
            raise TensorParallelMismatch(
                f"request {rid}: rank 0 sampled tokens {list(tokens)}, this rank {ours}. The ranks' logits "
                f"differ, so a collective did not give every rank the same result; report this with the Hal "
                f"and dist backend in use")
        if ours is not None:
            self.num_checked_tokens += min(len(ours), len(tokens))
