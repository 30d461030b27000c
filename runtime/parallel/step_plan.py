"""Step plans: how rank 0's engine drives the other tensor-parallel ranks.

The scheduler, block manager, prefix cache, tokenizer and stop checks run on rank 0 only (the
driver). After each `schedule()` its `PlanPublisher` sends a compact `StepPlan`: the requests the
followers have not seen (prompt and sampling settings, once), per scheduled request its computed
tokens, the item (token count; wavefront start and depth; drafts of a speculation round), the tokens
rank 0 appended since it was last scheduled and the block ids added to its tables (all of them after
a preemption or a trim), and the KV moves of the step (swap out / in, runner state to forget). This
module holds the messages and the driver's side; the other ranks replay them in
runtime/parallel/follower.py (`Follower`).

Synchronous speculation replays exactly: drafts and acceptance depend only on the logits (the same on
every rank) and on the request's seed. Not replayed, so refused with tp > 1 (`check_supported`):
async scheduling (the driver plans step t+1 before it knows step t's tokens) and async speculation
(the next round's draft allocates blocks mid-round, after the plan went out).

Why broadcast plans rather than run the scheduler on every rank: requests reach rank 0 only (the
server, the CLI), and the scheduler's decisions then cannot drift between ranks by construction
(future policies may look at clocks or host memory). Plans cost one small gloo broadcast per step.
The driver seeds unseeded requests (`PlanPublisher.seeded`) so that every rank samples alike.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Container, Mapping, NamedTuple

from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.engine.kv_cache import BlockManager
from runtime.engine.step_schedule import SchedulerOutput
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

    def __init__(self, channel: Any, seed: int | None = None) -> None:
        """`seed`: unseeded requests' seeds are drawn from it (`LLM(seed=)`: reproducible runs);
        None draws them from the OS."""
        self.channel = channel
        self._seeds = random.SystemRandom() if seed is None else random.Random(seed)
        self._reset()

    def _reset(self) -> None:
        self.known: dict[str, Request] = {}               # requests the followers hold
        self.sent_tokens: dict[str, int] = {}             # tokens of each the followers have
        self.sent_tables: dict[str, list[list[int]]] = {}

    def seeded(self, params: SamplingParams) -> SamplingParams:
        """`params` with a seed: every rank must draw the same numbers (sampling, initial states)."""
        if params.seed is not None:
            return params
        return dataclasses.replace(params, seed=self._seeds.getrandbits(63))

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
