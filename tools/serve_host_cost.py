"""The host's part of a decode step when the engine serves streams over HTTP, on the CPU: what
`runtime.serve` adds to `engine.step()`, at the batch sizes the benchmarks run.

    python tools/serve_host_cost.py [--model ouro-1.4b] [--requests 64] [--context 1024] [--tokens 64]
    python tools/serve_host_cost.py --hal cuda --full      # on a GPU: the real shapes, replays on
    python tools/serve_host_cost.py --loop uvloop          # the server on uvloop (pip install uvloop)

Why: `runtime.bench` drives the engine directly, but a server's engine thread shares the
interpreter with the HTTP event loop (one GIL): every step's outputs are detokenized, turned into
one server-sent event per stream and written to a socket. Whatever of that runs while the engine
thread wants the interpreter lengthens the step. Here the model keeps the real one's planes and
loops at one narrow layer (`prefill_host_cost.narrow_model`, vocabulary 512, a word-level
tokenizer of its own), every graph replay is a no-op, so the device does nothing, and the
engine's decode steps are timed twice: driven directly (as `runtime.bench` does) and behind the
app (`runtime.server.app.build_app`, uvicorn on a loopback port) while a second process streams
`--requests` completions of `--tokens` tokens each (temperature 0, ignore_eos). Only steps in
which every request decodes count. The client process only counts bytes, but on a machine with
few cores it still takes CPU from the server: read the result with the core count it prints.
With `--full` the model has its real shapes (random weights, bf16 off the CPU) and the replays run,
so on a GPU the two numbers are the decode step a benchmark sees and the one a server's users see.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import hal
import zoo
from hal.common.graph import EagerGraph
from prefill_host_cost import CONFIGS, narrow_model, num_planes
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.text.tokenizer import Tokenizer

def word_tokenizer(vocab_size: int) -> Tokenizer:
    """A word-level tokenizer over `vocab_size` words (id i is "w<i>"; id 0 the end token)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    backend = Backend(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")        # joins words with spaces, as text
    folder = Path(tempfile.mkdtemp())
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w0"}))
    return Tokenizer.from_folder(folder)


def make_model(name: str, device_hal, full: bool, max_len: int):
    """The narrowed model (replays off), or with `full` the real shapes with random weights."""
    if not full:
        return narrow_model(name, max_len)
    device = device_hal.device()
    return zoo.from_config(CONFIGS / f"{name}.json", dtype="float32" if device.type == "cpu" else "bfloat16",
                           device=device, seed=0)


def make_engine(model, device_hal, num_requests: int, context: int, num_tokens: int) -> LLMEngine:
    max_model_len = context + num_tokens + 8
    block_size = device_hal.caps.kv_block_sizes[0]
    blocks_per_request = -(-max_model_len // block_size)
    return LLMEngine(model, device_hal, EngineConfig(
        max_num_seqs=num_requests, max_model_len=max_model_len, block_size=block_size, graphs=True,
        max_num_batched_tokens=max(2048, context),
        num_kv_blocks=num_planes(model) * (num_requests * blocks_per_request + 2)),
        tokenizer=word_tokenizer(model.config.vocab_size))


class StepClock:
    """Wraps `engine.step`: the wall time of each step in which all `num_requests` requests decode."""

    def __init__(self, engine: LLMEngine, num_requests: int) -> None:
        self.engine, self.num_requests = engine, num_requests
        self.step_ms: list[float] = []
        self.inside_ms: list[float] = []       # of which engine.step itself
        self._step, self._last = engine.step, None
        engine.step = self.step

    def step(self):
        running = self.engine.scheduler.running
        decoding = len(running) == self.num_requests and not any(r.is_prefill for r in running)
        start = time.perf_counter()
        out = self._step()
        end = time.perf_counter()
        if decoding and self._last is not None:
            self.step_ms.append((start - self._last) * 1e3 + (end - start) * 1e3)
            self.inside_ms.append((end - start) * 1e3)
        self._last = end if decoding else None
        return out


def prompt(i: int, context: int) -> list[int]:
    return [(i * 7 + j) % 500 + 1 for j in range(context)]


def direct(engine: LLMEngine, num_requests: int, context: int, num_tokens: int) -> StepClock:
    from runtime.sampling_params import SamplingParams

    clock = StepClock(engine, num_requests)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    for i in range(num_requests):
        engine.add_request(f"d{i}", prompt(i, context), params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step = clock._step
    return clock


async def stream_all(port: int, num_requests: int, context: int, num_tokens: int) -> tuple[int, int]:
    """Stream the completions concurrently; (events, bytes) received."""
    async def one(i: int) -> tuple[int, int]:
        body = json.dumps({"prompt": prompt(i, context), "max_tokens": num_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        data = await reader.read()           # until the server closes the connection
        writer.close()
        return data.count(b"data: "), len(data)

    counts = await asyncio.gather(*(one(i) for i in range(num_requests)))
    return sum(c for c, _ in counts), sum(n for _, n in counts)


def client(port: int, num_requests: int, context: int, num_tokens: int, result) -> None:
    start = time.process_time()
    events, size = asyncio.run(stream_all(port, num_requests, context, num_tokens))
    result.put((events, size, time.process_time() - start))


def served(engine: LLMEngine, num_requests: int, context: int, num_tokens: int,
           loop: str = "asyncio") -> tuple[StepClock, tuple]:
    from runtime.server.app import build_app
    from runtime.server.config import ServerConfig
    from runtime.server.http_server import make_server

    clock = StepClock(engine, num_requests)
    server = make_server(build_app(engine, ServerConfig(max_num_requests=4 * num_requests)), log_level="warning",
                         loop=loop)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    ctx = multiprocessing.get_context("spawn")
    result = ctx.Queue()
    proc = ctx.Process(target=client, args=(sock.getsockname()[1], num_requests, context, num_tokens, result))
    proc.start()
    got = result.get(timeout=1800)
    proc.join()
    server.should_exit = True
    thread.join(60)
    return clock, got


def summary(label: str, clock: StepClock) -> str:
    if not clock.step_ms:
        return f"{label}: no step had every request decoding"
    return (f"{label}: {statistics.median(clock.step_ms):.3f} ms per decode step, engine.step "
            f"{statistics.median(clock.inside_ms):.3f} ms of it (medians of {len(clock.step_ms)} steps)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ouro-1.4b", choices=sorted(p.stem for p in CONFIGS.glob("*.json")))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hal", default="cpu")
    parser.add_argument("--full", action="store_true", help="the real shapes, random weights, replays on")
    parser.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop"],
                        help="the server's event loop (uvloop must be installed)")
    args = parser.parse_args()
    if not args.full:
        EagerGraph.replay = lambda self: None      # no device work at all: what is left is host time
    device_hal = hal.get(args.hal)
    model = make_model(args.model, device_hal, args.full, args.context + args.tokens + 64)
    print(f"{args.model} ({'real shapes' if args.full else 'one narrow layer, replays off'}) on "
          f"{device_hal.device()}, {args.requests} requests x ({args.context} in, {args.tokens} out), "
          f"{os.cpu_count()} CPUs")
    engine = make_engine(model, device_hal, args.requests, args.context, args.tokens)
    print(summary("engine driven directly", direct(engine, args.requests, args.context, args.tokens)))
    del engine                                 # its KV cache, before the second engine takes one
    gc.collect()
    device_hal.empty_cache()
    engine = make_engine(model, device_hal, args.requests, args.context, args.tokens)
    clock, (events, size, client_cpu_s) = served(engine, args.requests, args.context, args.tokens, args.loop)
    print(summary(f"behind runtime.serve's app ({args.loop})", clock))
    print(f"the client received {events} events ({size / 1e6:.1f} MB) and used {client_cpu_s:.1f} s of CPU")


if __name__ == "__main__":
    main()
