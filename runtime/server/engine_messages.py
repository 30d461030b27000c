"""What passes between the HTTP handlers and the engine thread of runtime/server/engine_loop.py.

Handlers build `NewRequest`s and get `Overloaded` / `ShuttingDown` when the loop refuses them; the
commands they queue for the thread are `AddCommand`, `AbortCommand` and `StopCommand`; the thread
publishes an `EngineState` after every iteration. Each admitted request has a `Sink` (its handler's
queue and event loop, and its token timing for the metrics), and `deliver` hands outputs over to
the event loops, since only the loop that owns an `asyncio.Queue` may touch it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import NamedTuple

from runtime.sampling_params import SamplingParams
from runtime.engine.outputs import RequestOutput
from runtime.server.metrics import ServerMetrics


class Overloaded(Exception):
    """Too many requests queued and running: answer 429 and let the client retry."""


class ShuttingDown(Exception):
    """The loop no longer accepts requests."""


class EngineStopped(ShuttingDown):
    """The loop ended on an error (not a shutdown): only a restart brings it back."""


class NewRequest(NamedTuple):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


class EngineState(NamedTuple):
    """A snapshot the engine thread publishes after every iteration (read from any thread)."""
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int

    @classmethod
    def of(cls, engine) -> EngineState:
        """An `LLMEngine`'s counts now, read where nothing steps it concurrently (its loop's thread)."""
        scheduler, blocks = engine.scheduler, engine.blocks
        return cls(len(scheduler.running), len(scheduler.waiting), blocks.num_free_blocks, blocks.num_blocks)


@dataclasses.dataclass
class Sink:
    """Where one request's outputs go, and its timing for the metrics (engine thread only)."""
    queue: asyncio.Queue                 # shared by the requests of one add, gets (index, output)
    index: int
    loop: asyncio.AbstractEventLoop
    arrival_time: float
    num_prompt_tokens: int
    tokens_seen: dict[int, int] = dataclasses.field(default_factory=dict)        # sample -> tokens counted
    last_token_time: dict[int, float] = dataclasses.field(default_factory=dict)  # sample -> when

    def record_tokens(self, out: RequestOutput, now: float, metrics: ServerMetrics) -> None:
        """Every sample's new tokens (n > 1: each sample's own; the request's first token once)."""
        for sample in out.outputs:
            seen = self.tokens_seen.get(sample.index, 0)
            for loops in sample.loops_per_token[seen:]:
                is_first = not self.tokens_seen
                last = self.last_token_time.get(sample.index, self.arrival_time)
                metrics.on_token(now - last, loops, is_first)
                seen += 1
                self.tokens_seen[sample.index] = seen
                self.last_token_time[sample.index] = now


class AddCommand(NamedTuple):
    requests: list[NewRequest]
    sinks: list[Sink]
    future: concurrent.futures.Future


class AbortCommand(NamedTuple):
    request_id: str
    finish_reason: str


class StopCommand(NamedTuple):
    deadline: float          # keep stepping admitted requests until then, then abort what is left


def deliver(deliveries: list[tuple[Sink, RequestOutput]]) -> None:
    """Hand outputs to their requests' event loops: one thread-safe callback per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Sink, RequestOutput]]] = {}
    for sink, out in deliveries:
        by_loop.setdefault(sink.loop, []).append((sink, out))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:                     # the event loop is closed: nobody is listening
            pass


def _put_all(items: list[tuple[Sink, RequestOutput]]) -> None:
    for sink, out in items:
        sink.queue.put_nowait((sink.index, out))
