"""The host's part of a captured decode step, on the CPU, at a small and at the model's own
max_model_len: what a user who leaves `engine.max_model_len` unset pays for it.

    python tools/decode_host_cost.py [--model ouro-1.4b] [--requests 64] [--context 1024] [--repeats 20]
                                     [--repetition-penalty 1.1]

Why: every `runtime.bench` cell sets max_model_len from its workload, so the benchmarks never see
what grows with it. A captured pass's metadata has room for max_model_len's blocks; here the model
keeps the real one's planes and loops at one narrow layer (`prefill_host_cost.narrow_model`), the
engine runs its captured decode path with the replay turned into a no-op, and what is left is host
time. The Triton backend's `update_meta` for the same batch (what the CUDA Hal stages before each
replay) is timed on its own after it. With `--repetition-penalty`, every request has one, so each
step also builds the penalties' token tables from the requests' prompts and outputs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch

import hal
from hal.attention import MetaCapacity, PagedBatch
from hal.common.graph import EagerGraph
from hal.kernels.backend import TritonPagedAttention
from hal.kernels.configs import configs_for
from prefill_host_cost import CONFIGS, median_ms, narrow_model, num_planes
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.sampling_params import SamplingParams

BLOCK = 16


def decode_step_ms(model, num_requests: int, context: int, max_model_len: int, repeats: int,
                   repetition_penalty: float = 1.0) -> float:
    """Median host ms of one decode step of `num_requests` requests at about `context` tokens."""
    planes = num_planes(model)
    per_request = -(-(context + repeats + 8) // BLOCK)
    # the pool holds the requests, and one request of max_model_len (admission asks for that)
    num_blocks = planes * max(num_requests * per_request, -(-max_model_len // BLOCK) + 1)
    engine = LLMEngine(model, hal.get("cpu"), EngineConfig(
        max_num_seqs=num_requests, max_model_len=max_model_len, block_size=BLOCK, graphs=True,
        max_num_batched_tokens=max(2048, context), num_kv_blocks=num_blocks))
    params = SamplingParams(max_tokens=repeats + 8, temperature=0.0, ignore_eos=True,
                            repetition_penalty=repetition_penalty)
    for i in range(num_requests):
        engine.add_request(str(i), [(i + j) % 500 + 1 for j in range(context)], params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < context for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()                          # the decode graph of this bucket is captured
    replay = EagerGraph.replay
    EagerGraph.replay = lambda self: None      # from here on, no device work at all
    try:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
    finally:
        EagerGraph.replay = replay
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ouro-1.4b", choices=sorted(p.stem for p in CONFIGS.glob("*.json")))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    own = json.loads((CONFIGS / f"{args.model}.json").read_text())
    longest = own.get("max_position_embeddings") or own["block_size"]     # Huginn names it block_size
    model = narrow_model(args.model, longest)
    planes = num_planes(model)
    small = args.context + args.repeats + 16
    for max_model_len in (small, longest):
        ms = decode_step_ms(model, args.requests, args.context, max_model_len, args.repeats, args.repetition_penalty)
        print(f"{args.model}: decode step of {args.requests} requests at {args.context} tokens (repetition "
              f"penalty {args.repetition_penalty}), max_model_len {max_model_len}: host {ms:.3f} ms "
              f"(median of {args.repeats})")
    backend = TritonPagedAttention(16, 16, 128, torch.bfloat16, torch.device("cpu"), BLOCK, configs_for("default"),
                                   num_compute_units=132)
    used = -(-args.context // BLOCK)
    tables = np.arange(planes * args.requests * used, dtype=np.int32).reshape(planes, args.requests, used)
    batch = PagedBatch(np.ones(args.requests, dtype=np.int64), np.full(args.requests, args.context), tables, BLOCK)
    for max_model_len in (small, longest):
        capacity = MetaCapacity(args.requests, args.requests, -(-max_model_len // BLOCK), planes, max_model_len)
        meta = backend.build_meta(batch, capacity)
        print(f"the Triton backend's update_meta at max_model_len {max_model_len}: "
              f"{median_ms(lambda: backend.update_meta(meta, batch), 50):.3f} ms")


if __name__ == "__main__":
    main()
