"""Step plans: how rank 0's engine drives the other tensor-parallel ranks.

The scheduler, block manager, prefix cache, tokenizer and stop checks run on rank 0 only (the
driver). After each `schedule()` its `PlanPublisher` sends a compact `StepPlan`: the requests the
followers have not seen (prompt and sampling settings, once), per scheduled request its computed
tokens, the item (token count; wavefront start and depth; drafts of a speculation round), the tokens
rank 0 appended since it was last scheduled and the block ids added to its tables (all of them after
a preemption or a trim), and the KV moves of the step (swap out / in, runner state to forget). A
`Follower` mirrors just enough of each request to make the same `ModelRunner.execute`,
`Speculator.run` and `SwapSpace` calls: same batch, same block ids, its own heads' cache.

Synchronous speculation replays exactly: drafts and acceptance depend only on the logits (the same on
every rank) and on the request's seed. Not replayed, so refused with tp > 1 (`check_supported`):
async scheduling (the driver plans step t+1 before it knows step t's tokens) and async speculation
(the next round's draft allocates blocks mid-round, after the plan went out).

Why broadcast plans rather than run the scheduler on every rank: requests reach rank 0 only (the
server, the CLI), and the scheduler's decisions then cannot drift between ranks by construction
(future policies may look at clocks or host memory). Plans cost one small gloo broadcast per step.

Sampling stays identical on all ranks: the head's all-gather gives every rank the same logits, and
each request's generator is seeded the same everywhere (the driver gives unseeded requests a seed),
so Huginn's random initial states and sampled tokens agree. Followers sample too, and check their
token against the one rank 0 sends in the next plan.
"""
from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass
from typing import Any, Container, Mapping, NamedTuple

from hal.base import Hal
from runtime.config import EngineConfig, SamplingParams
from runtime.engine.kv_cache import BlockManager
from runtime.execution.sampler import make_generator
from runtime.engine.step_schedule import ScheduledRequest, SchedulerOutput
from runtime.engine.sequence import Request


@dataclass(frozen=True)
class OpenEngine:
    """An engine starts on the driver: followers build their runner (and KV cache) alike."""

    config: EngineConfig
    max_model_len: int
    max_loops: int


@dataclass(frozen=True)
class CloseEngine:
    """The driver's engine is gone: followers free their runner and KV cache."""


@dataclass(frozen=True)
class StopFollowing:
    """The driver is done with this model: `Follower.run` returns (the rank may load another)."""


class NewRequest(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    num_loops: int
    exit_threshold: float
    num_planes: int
    stop_token_ids: frozenset[int] = frozenset()     # the engine's stops (min_tokens masks them)


class PlanItem(NamedTuple):
    request_id: str
    num_computed_tokens: int             # the request's computed tokens when the step starts
    num_tokens: int                      # the `ScheduledRequest`'s fields from here
    start: int | None
    depth: int
    is_wave: bool
    num_draft_tokens: int                # > 0: a speculation round (`Speculator.run`)
    new_token_ids: tuple[int, ...]       # generated tokens followers have not seen yet
    tables: list[list[int]] | None       # [plane][block] to append (or the whole tables); None: unchanged
    reset_tables: bool                   # replace this request's tables by `tables`


class StepPlan(NamedTuple):
    new_requests: list[NewRequest]
    finished: list[str]                  # requests gone since the last plan (finished, aborted)
    forget: list[str]                    # preempted without swapping: `ModelRunner.forget`
    swap_out: list[tuple[str, list[int]]]   # (request, blocks) copies before the step, in order
    swap_in: list[tuple[str, list[int]]]
    items: list[PlanItem]


class TensorParallelMismatch(RuntimeError):
    """Ranks of one tensor-parallel run disagree (their logits differ)."""


def check_supported(config: EngineConfig) -> None:
    """Raise a ValueError naming the fix for engine features the followers cannot replay."""
    refused = []
    if config.async_scheduling:
        refused.append(("async scheduling", "engine.async_scheduling=false"))
    if config.speculative.is_enabled and config.speculative.mode != "sync":
        refused.append(("asynchronous speculation", "engine.speculative.mode=sync"))
    if config.weights_dtype == "fp8":          # the row-parallel linears are not FP8 linears (docs/fp8.md)
        refused.append(("FP8 weights", "engine.weights_dtype=auto"))
    if refused:
        raise ValueError(f"{' and '.join(w for w, _ in refused)} not implemented with tensor parallelism "
                         f"(rank 0 would plan work before the other ranks can know it); set "
                         f"{' and '.join(f for _, f in refused)} with parallel.tp > 1")


def _extends(sent: list[int], table: list[int]) -> bool:
    """`table` is `sent` with blocks appended (a speculation round's trim or a preemption breaks this)."""
    return len(table) >= len(sent) and table[:len(sent)] == sent


class PlanPublisher:
    """The driver's side: turns scheduler outputs into `StepPlan`s on the control channel."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self._reset()

    def _reset(self) -> None:
        self.known: dict[str, Request] = {}               # requests the followers hold
        self.sent_tokens: dict[str, int] = {}             # tokens of each the followers have
        self.sent_tables: dict[str, list[list[int]]] = {}

    def seeded(self, params: SamplingParams) -> SamplingParams:
        """`params` with a seed: every rank must draw the same numbers (sampling, initial states)."""
        return params if params.seed is not None else dataclasses.replace(params, seed=secrets.randbits(63))

    def open(self, config: EngineConfig, max_model_len: int, max_loops: int) -> None:
        self._reset()
        self.channel.send(OpenEngine(config, max_model_len, max_loops))

    def close(self) -> None:
        self._reset()
        self.channel.send(CloseEngine())

    def publish(self, output: SchedulerOutput, requests: Mapping[str, Request], blocks: BlockManager,
                swapped: Container[str] = ()) -> None:
        """Send the plan of one scheduled step (call it before the step's KV moves and launch).
        `swapped`: the scheduler's swapped-out request ids."""
        for request in output.preempted:
            self.sent_tables.pop(request.request_id, None)
        forget = [r.request_id for r in output.preempted if r.request_id not in swapped]
        moves = ([(c.request_id, list(c.blocks)) for c in output.swap_out],
                 [(c.request_id, list(c.blocks)) for c in output.swap_in])
        if output.is_empty and not (forget or moves[0] or moves[1]):
            return
        finished = [rid for rid, r in self.known.items() if requests.get(rid) is not r]
        for rid in finished:
            self._forget(rid)
        new_requests, items = [], []
        for item in output.scheduled:
            request, rid = item.request, item.request.request_id
            if rid not in self.known:
                new_requests.append(NewRequest(rid, list(request.prompt_token_ids), request.params,
                                               request.num_loops, request.exit_threshold, request.num_planes,
                                               request.stop_token_ids))
                self.known[rid] = request
                self.sent_tokens[rid] = len(request.prompt_token_ids)
            sent = self.sent_tokens[rid] - len(request.prompt_token_ids)
            new_tokens = tuple(request.output_token_ids[sent:])
            self.sent_tokens[rid] = request.num_tokens
            tables, reset = self._table_update(rid, blocks.block_tables(rid))
            items.append(PlanItem(rid, request.num_computed_tokens, item.num_tokens, item.start, item.depth,
                                  item.is_wave, item.num_draft_tokens, new_tokens, tables, reset))
        self.channel.send(StepPlan(new_requests, finished, forget, *moves, items))

    def _forget(self, rid: str) -> None:
        self.known.pop(rid, None)
        self.sent_tokens.pop(rid, None)
        self.sent_tables.pop(rid, None)

    def _table_update(self, rid: str, tables: list[list[int]]) -> tuple[list[list[int]] | None, bool]:
        sent = self.sent_tables.get(rid)
        if sent is None or len(sent) != len(tables) or not all(map(_extends, sent, tables)):
            self.sent_tables[rid] = [list(t) for t in tables]
            return [list(t) for t in tables], True
        added = [t[len(s):] for s, t in zip(sent, tables)]
        if not any(added):
            return None, False
        for s, a in zip(sent, added):
            s.extend(a)
        return added, False


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
