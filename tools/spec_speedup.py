"""End-to-end speed of self-speculative decoding on the packaged ouro-tiny, against plain decoding.

    python tools/spec_speedup.py [--hal cpu] [--new 128] [--draft-loops 1 2 3] [--dtype float32] [--model PATH]

Greedy continuation of a few KJV-style prompts, one request at a time (batch 1), timed after a
warm-up; prints tokens/s with speculation off and on (K=4), the acceptance rate, the speed-up, and
whether the tokens equal plain decoding's. A timing on a shared machine is only as steady as the
machine: run it alone. In bf16 (the checkpoint's dtype) a verify pass over K+1 rows and a one-row
decode step round differently, so a near-tie between the two best tokens (logits closer than
bf16's resolution) can flip and the texts part there; `--dtype float32` checks exact equality.
"""
from __future__ import annotations

import argparse
import time

from runtime import LLM, SamplingParams
from runtime.config import EngineConfig, SpeculativeConfig

PROMPTS = ["And God said unto Moses", "In the beginning", "The LORD is my shepherd", "Blessed are the"]


def timed(llm: LLM, params: SamplingParams) -> tuple[float, list[list[int]], float]:
    """(tokens per second, token ids per prompt, acceptance rate or nan)."""
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0))          # warm-up
    start, outs = time.perf_counter(), [llm.generate(p, params)[0] for p in PROMPTS]
    seconds = time.perf_counter() - start
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    ids = [list(o.token_ids) for o in outs]
    return sum(map(len, ids)) / seconds, ids, accepted / drafted if drafted else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hal", default="cpu")
    parser.add_argument("--model", default="ouro-tiny", help="a checkpoint folder (default: the packaged ouro-tiny)")
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--draft-loops", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--dtype", default=None, help="model dtype (default: the checkpoint's, bfloat16)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (default: sized from memory)")
    args = parser.parse_args()
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    kw = {"hal": args.hal, **({"dtype": args.dtype} if args.dtype else {})}
    base_rate, base_ids, _ = timed(LLM(args.model, engine_config=EngineConfig(num_kv_blocks=args.num_kv_blocks), **kw),
                                   params)
    print(f"speculation off: {base_rate:.1f} tok/s")
    for loops in args.draft_loops:
        config = EngineConfig(num_kv_blocks=args.num_kv_blocks, speculative=SpeculativeConfig(4, loops))
        llm = LLM(args.model, engine_config=config, **kw)
        rate, ids, acceptance = timed(llm, params)
        print(f"K=4, draft_loops={loops}: {rate:.1f} tok/s, acceptance {acceptance:.2f}, "
              f"speed-up {rate / base_rate:.2f}x, tokens {'equal' if ids == base_ids else 'DIFFER'}")


if __name__ == "__main__":
    main()
