"""TP=N greedy tokens against TP=1 at a real model's shape, random weights (seeded per tensor, so both
runs hold the same weights). Run under torchrun, one process per GPU:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tools/tp_greedy.py --model ouro-1.4b

Rank 0 first runs the whole model alone (TP=1) through the engine, then every rank builds its shard;
both models compute the prompts' logits densely (their max difference is reported), then the TP=N
engine generates. Greedy tokens are compared per prompt; at the first divergence the TP=1 top-2
logit margin there is printed, which says whether rounding (bf16) can explain it.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hal as hal_registry  # noqa: E402
import zoo  # noqa: E402
from runtime import SamplingParams  # noqa: E402
from runtime.llm import LLM, follow  # noqa: E402
from runtime.parallel import init_distributed  # noqa: E402


def dense_logits(model, ids: torch.Tensor) -> torch.Tensor:
    kwargs = {"init_scale": 0.0} if hasattr(model, "initial_state") else {}
    with torch.inference_mode():
        return model(ids, **kwargs).logits.float()


def margins(model, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[float]]:
    """TP=1 top-1 minus top-2 logit at each generated token (teacher-forced, dense)."""
    result = []
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt + out[:-1]], device=next(model.parameters()).device)
        top2 = dense_logits(model, ids)[0, len(prompt) - 1:].topk(2, dim=-1).values
        result.append((top2[:, 0] - top2[:, 1]).tolist())
    return result


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate(prompts, params)
    llm.close()
    return [o.token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="ouro-1.4b", help="a name in zoo/configs, or a config.json path")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--hal", default="cuda")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    named = ROOT / "zoo" / "configs" / f"{args.model}.json"
    config = Path(args.model) if args.model.endswith(".json") else named
    hal = hal_registry.get(args.hal)
    parallel = init_distributed(hal, int(os.environ.get("WORLD_SIZE", "1")))
    device = hal.device()
    vocab = json.loads(config.read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True, init_scale=0.0)
    engine = {"max_num_seqs": args.num_prompts, "max_model_len": args.prompt_len + args.new + 16,
              "kv_cache_memory_bytes": 8 << 30}
    batch = torch.tensor(prompts, device=device)
    try:
        if parallel.is_driver:
            full = zoo.from_config(config, dtype=args.dtype, device=device, seed=args.seed)
            ref_logits = dense_logits(full, batch)
            ref_tokens = generate(LLM(full, hal=hal, **engine), prompts, params)
            ref_margins = margins(full, prompts, ref_tokens)
            del full
            gc.collect()
            hal.empty_cache()
        shard = zoo.from_config(config, dtype=args.dtype, device=device, seed=args.seed,
                                **parallel.shard_args())
        tp_logits = dense_logits(shard, batch)                      # collective: every rank
        if not parallel.is_driver:
            follow(shard, hal, None, parallel)
            return
        tp_tokens = generate(LLM(shard, hal=hal, parallel=parallel, **engine), prompts, params)
    finally:
        parallel.shutdown()
    report(args, parallel.world_size, ref_logits, tp_logits, ref_tokens, tp_tokens, ref_margins)


def report(args, tp, ref_logits, tp_logits, ref_tokens, tp_tokens, ref_margins) -> None:
    diff = (ref_logits - tp_logits).abs().max().item()
    same_argmax = (ref_logits.argmax(-1) == tp_logits.argmax(-1)).float().mean().item()
    print(f"[tp_greedy] {args.model} {args.dtype}: prompt logits max |TP={tp} - TP=1| = {diff:.4g} "
          f"(logit scale {ref_logits.abs().max().item():.3g}); argmax agreement {same_argmax:.4f}")
    equal = 0
    for i, (ref, ours, margin) in enumerate(zip(ref_tokens, tp_tokens, ref_margins)):
        if ref == ours:
            equal += 1
            continue
        at = next(j for j, (a, b) in enumerate(zip(ref, ours)) if a != b)
        before = min(margin[:at] or [float("nan")])
        print(f"[tp_greedy]   prompt {i}: first divergence at token {at} of {len(ref)}; TP=1 top-2 margin "
              f"there {margin[at]:.4g} (smallest margin before it {before:.4g})")
    verdict = "PASS" if equal == len(ref_tokens) else "DIVERGED"
    print(f"[tp_greedy] {verdict}: {equal}/{len(ref_tokens)} prompts give identical greedy tokens "
          f"({args.new} tokens each), TP={tp} vs TP=1, {args.model} {args.dtype}, random weights")


if __name__ == "__main__":
    main()
