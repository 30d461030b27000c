"""Where a decode step's time goes: torch.profiler over a few engine steps of a real-shape model with
random weights, printing the kernels by total device time.

    python tools/profile_step.py --model ouro-1.4b --batch 1 --context 256 [--graphs 0|1] [--steps 5] [--fp8]

`--fp8`: FP8 weights and KV cache (`engine.weights_dtype=fp8 engine.kv_dtype=fp8`).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import hal
import zoo
from runtime.config import EngineConfig
from runtime.sampling_params import SamplingParams
from runtime.engine.llm_engine import LLMEngine

CONFIGS = Path(__file__).resolve().parent.parent / "zoo" / "configs"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="ouro-1.4b")
    parser.add_argument("--hal", default="auto")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--graphs", type=int, default=1)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--fp8", action="store_true", help="FP8 weights and KV cache")
    args = parser.parse_args()

    device_hal = hal.get(args.hal)
    model = zoo.from_config(CONFIGS / f"{args.model}.json", dtype="bfloat16", device=device_hal.device(), seed=0)
    fp8 = dict(weights_dtype="fp8", kv_dtype="fp8") if args.fp8 else {}
    engine = LLMEngine(model, device_hal, EngineConfig(max_num_seqs=args.batch, graphs=bool(args.graphs), **fp8,
                                                       max_model_len=args.context + 64 + args.steps,
                                                       max_num_batched_tokens=8192))
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), torch.randint(1, model.config.vocab_size, (args.context,), generator=gen).tolist(),
                           params)
    while engine.scheduler.waiting or any(r.is_prefill for r in engine.scheduler.running):
        engine.step()                                     # prefill
    for _ in range(3):                                    # graph capture, warm-up
        engine.step()
    device_hal.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    device_hal.synchronize()
    wall = (time.perf_counter() - start) / args.steps
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        device_hal.synchronize()
    print(f"{args.model} batch {args.batch} context {args.context} graphs {bool(args.graphs)}: "
          f"{wall * 1e3:.3f} ms/step wall (unprofiled)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
