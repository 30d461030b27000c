"""`EngineLoop`: the one thread that owns an `LLMEngine` and steps it.

The engine is synchronous and not thread-safe, so nothing else touches it. HTTP handlers (on the
asyncio event loop) send it commands through a thread-safe queue: add requests, abort one, stop
(those messages, the sinks and their delivery are runtime/server/engine_messages.py).
The thread answers an add through a `concurrent.futures.Future` (admitted, or the engine's
ValueError / MemoryError) and sends the outputs of the added requests, as `(index, output)`, to one
`asyncio.Queue` per add with `call_soon_threadsafe`, one callback per step. Every request that
leaves the engine (finished, aborted, failed) gets a final output with `finished=True`, and its KV
blocks are freed.

    handler --add/abort--> SimpleQueue --> [engine thread: drain commands, engine.step()] --outputs-->
            <----------------- asyncio.Queue per API request (call_soon_threadsafe) ----------
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Sequence

import torch

from runtime.engine.llm_engine import LLMEngine
from runtime.engine.outputs import RequestOutput
from runtime.server.engine_messages import (AbortCommand, AddCommand, EngineState, EngineStopped, NewRequest,
                                            Overloaded, ShuttingDown, Sink, StopCommand, deliver)
from runtime.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.005       # how long to wait for commands when the engine has requests it cannot schedule yet


class EngineDead(RuntimeError):
    """A step failed where the engine cannot go on (tensor parallelism: ranks may disagree)."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 max_num_requests: int = 512) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.max_num_requests = max_num_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()
        self._num_in_flight = 0               # admitted and not yet out of the engine (guarded by _lock)
        self._is_accepting = False
        self._thread: threading.Thread | None = None
        self._stop: StopCommand | None = None
        self.state = EngineState.of(self.engine)
        self.error: BaseException | None = None   # what killed the thread, if anything

    # ----- any thread ---------------------------------------------------------------------------
    def start(self) -> None:
        self._publish_state()        # the pool's gauges from the start, not from the first request on
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._is_accepting = True
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def is_accepting(self) -> bool:
        """False once shutdown began: new requests get 503 while admitted ones drain."""
        return self._is_accepting and self.is_alive

    @property
    def stop_reason(self) -> str | None:
        """Why the loop ended on an error (None while it runs or after a shutdown): only a restart helps."""
        return None if self.error is None else f"the engine loop stopped: {self.error}"

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    async def add(self, requests: Sequence[NewRequest], arrival_time: float) -> asyncio.Queue:
        """Admit requests all together (or none); their outputs arrive on the returned queue as
        `(index in requests, RequestOutput)`, the last one of each finished. Raises Overloaded
        or ShuttingDown before anything reaches the engine, and the engine's ValueError/MemoryError
        (the others of the batch are then withdrawn)."""
        if len(requests) > self.max_num_requests:     # would wait forever: not a retry-later case
            raise ValueError(f"{len(requests)} prompts in one request; this server takes at most "
                             f"{self.max_num_requests} at once (server.max_num_requests): split the batch")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        sinks = [Sink(outputs, i, loop, arrival_time, len(r.prompt_token_ids))
                 for i, r in enumerate(requests)]
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:        # queued under the lock: the thread refuses leftovers after it stops accepting
            if self.stop_reason is not None:
                raise EngineStopped(self.stop_reason)
            if not self._is_accepting or not self.is_alive:
                raise ShuttingDown("the server is shutting down")
            if self._num_in_flight + len(requests) > self.max_num_requests:
                raise Overloaded(f"{self._num_in_flight} requests are queued or running (limit "
                                 f"{self.max_num_requests}); retry later")
            self._num_in_flight += len(requests)
            self._commands.put(AddCommand(list(requests), sinks, future))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            for r in requests:           # the client left before admission: withdraw them
                self.abort(r.request_id)
            raise
        return outputs

    def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        """Stop a request and free its blocks (ignored when it already left the engine).
        `finish_reason` is what its final output and the metrics say ("stop" for a stop string)."""
        self._commands.put(AbortCommand(request_id, finish_reason))

    def shutdown(self, drain_timeout_s: float = 0.0, join_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let admitted ones run for up to `drain_timeout_s`, abort the rest
        (each gets a final output with finish_reason "abort"), and end the thread. Blocks until then;
        safe to call again (the earliest deadline wins)."""
        with self._lock:
            self._is_accepting = False
        if self._thread is None or not self._thread.is_alive():
            return
        self._commands.put(StopCommand(time.monotonic() + drain_timeout_s))
        self._thread.join(drain_timeout_s + join_timeout_s)
        if self._thread.is_alive():
            log.error("the engine thread did not stop within %.0f s", drain_timeout_s + join_timeout_s)

    # ----- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._should_exit():
                    is_idle = not self.engine.has_unfinished_requests()
                    self._handle_commands(timeout_s=None if is_idle else 0.0)   # sleep only when idle
                    if self.engine.has_unfinished_requests() and not self._step():
                        self._handle_commands(timeout_s=IDLE_POLL_S)          # nothing schedulable: no spin
                    self._publish_state()
        except EngineDead as exc:               # logged where the step failed
            self.error = exc
            self._fail_all(str(exc))
        except BaseException as exc:            # a bug: fail every request rather than hang them
            log.exception("the engine loop died")
            self.error = exc
            self._fail_all(f"the engine loop died: {exc}")
        finally:
            with self._lock:
                self._is_accepting = False
            self._abort_all()
            self._refuse_pending()
            self._publish_state()

    def _should_exit(self) -> bool:
        if self._stop is None:
            return False
        return not self.engine.has_unfinished_requests() or time.monotonic() >= self._stop.deadline

    def _handle_commands(self, timeout_s: float | None) -> None:
        """Run the queued commands, waiting up to `timeout_s` (None: forever) for the first."""
        try:
            if timeout_s == 0.0:
                command = self._commands.get_nowait()
            else:
                command = self._commands.get(timeout=timeout_s)
        except queue.Empty:
            return
        while True:
            if isinstance(command, AddCommand):
                self._add(command)
            elif isinstance(command, AbortCommand):
                self._abort(command.request_id, command.finish_reason)
            elif isinstance(command, StopCommand):
                if self._stop is None or command.deadline < self._stop.deadline:
                    self._stop = command
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, command: AddCommand) -> None:
        if not command.future.set_running_or_notify_cancel():
            self._release(len(command.requests))      # the client left before we got to it
            return
        added = []
        try:
            for request, sink in zip(command.requests, command.sinks):
                self.engine.add_request(request.request_id, request.prompt_token_ids, request.params,
                                        prompt=request.prompt)
                self._sinks[request.request_id] = sink
                added.append(request.request_id)
        except Exception as exc:                # ValueError / MemoryError: bad or oversized input
            for request_id in added:
                self.engine.abort(request_id)
                self._sinks.pop(request_id)
            self._release(len(command.requests))
            command.future.set_exception(exc)
            return
        command.future.set_result(None)

    def _step(self) -> bool:
        """One engine step; False when it had nothing it could schedule."""
        num_steps = self.engine.num_steps
        try:
            outputs = self.engine.step()
        except Exception as exc:                # one rank: fail the batch, free its blocks, keep serving
            log.exception("engine step failed")
            if self.engine.is_tensor_parallel:  # the other ranks may have run the step or wait inside it:
                raise EngineDead(               # nothing after this is known to agree, so the loop ends
                    f"the engine failed with tensor parallelism ({exc}); its ranks may no longer agree, "
                    "so this server stopped taking requests (/health answers 503): restart it") from exc
            self._fail_all(f"the engine failed: {exc}")
            return True
        now = time.monotonic()
        deliveries = []
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            sink.record_tokens(out, now, self.metrics)
            if out.finished:
                self._finish(out.request_id, out.finish_reason or "stop", now)
            deliveries.append((sink, out))
        deliver(deliveries)
        return self.engine.num_steps > num_steps

    def _finish(self, request_id: str, finish_reason: str, now: float) -> Sink:
        sink = self._sinks.pop(request_id)
        self._release(1)
        self.metrics.on_finish(finish_reason, sink.num_prompt_tokens, now - sink.arrival_time)
        return sink

    def _abort(self, request_id: str, finish_reason: str = "abort", error: str | None = None) -> None:
        if request_id not in self._sinks:
            return                               # already finished (or withdrawn)
        out = RequestOutput(request_id, None, [], finished=True, finish_reason=finish_reason, error=error)
        try:
            known = self.engine.output_for(request_id, finish_reason)
            self.engine.abort(request_id)
            if known is not None:
                out = dataclasses.replace(known, error=error)
        except Exception:                        # the engine is broken; the request still gets its answer
            log.exception("could not abort %s", request_id)
        finally:
            deliver([(self._finish(request_id, finish_reason, time.monotonic()), out)])

    def _abort_all(self) -> None:
        for request_id in list(self._sinks):
            self._abort(request_id)

    def _fail_all(self, message: str) -> None:
        for request_id in list(self._sinks):
            self._abort(request_id, "error", message)

    def _refuse_pending(self) -> None:
        """Answer adds that raced with the stop (nobody reads the queue after this thread ends)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, AddCommand):
                self._release(len(command.requests))
                if command.future.set_running_or_notify_cancel():
                    command.future.set_exception(
                        EngineStopped(self.stop_reason) if self.stop_reason is not None
                        else ShuttingDown("the server is shutting down"))

    def _release(self, num_requests: int) -> None:
        with self._lock:
            self._num_in_flight -= num_requests

    def _publish_state(self) -> None:
        self.state = state = EngineState.of(self.engine)
        self.metrics.on_engine_state(*state)

