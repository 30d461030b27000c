"""Tensor-parallel jobs for test_tensor_parallel.py, run by torchrun (one process per rank, gloo):

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/runtime/tp_worker.py OUT.json

Rank 0 drives an `LLM` per job and writes `{job: [tokens per request]}` to OUT.json; the other
ranks follow. `run_job` with a single-process `ParallelState` gives the tp=1 tokens to compare.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, NamedTuple

import torch

import hal as hal_registry
import zoo
from helpers import golden_case, golden_names
from runtime import SamplingParams
from runtime.llm import LLM, follow
from runtime.parallel.state import ParallelState, init_distributed

MQA_OURO = {"model_type": "ouro", "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 8,
            "total_ut_steps": 3, "max_position_embeddings": 64, "rope_theta": 10000.0,
            "initializer_range": 0.3}


class Job(NamedTuple):
    name: str
    source: Callable[[ParallelState], Any]        # a checkpoint folder, or a model built for this rank
    requests: list[tuple[list[int], SamplingParams]]
    engine: dict[str, Any]
    compare: list[bool] | None = None             # per request: compare with tp=1 (None: with the golden)


def golden_params(case) -> SamplingParams:
    return SamplingParams(max_tokens=case.meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True,
                          num_loops=case.meta.get("greedy_num_steps"), init_scale=0.0)


def jobs() -> list[Job]:
    out = []
    for name in golden_names():
        case = golden_case(name)
        requests = [(case.prompt(i), golden_params(case)) for i in range(case.num_prompts)]
        out.append(Job(name, lambda p, path=case.path: path, requests,
                       {"max_num_batched_tokens": 7, "block_size": 4}))
    case = golden_case("ouro-tiny-gqa-bf16")          # room for the longer request (3 x 8 blocks) and a
    requests = [(case.prompt(i), golden_params(case)) for i in range(case.num_prompts)]   # bit: preemption
    out.append(Job("preempt:ouro-tiny-gqa-bf16", lambda p, path=case.path: path, requests,
                   {"block_size": 4, "num_kv_blocks": 26, "max_num_batched_tokens": 16}))
    out.append(Job("swap-prefix-wavefront:ouro-tiny-gqa-bf16", lambda p, path=case.path: path, requests,
                   {"block_size": 4, "num_kv_blocks": 26, "max_num_batched_tokens": 6,
                    "preemption_mode": "swap", "enable_prefix_caching": True, "wavefront_prefill": True}))
    case = golden_case("ouro-tiny")                   # speculation rounds (trained: drafts are often kept)
    requests = [(case.prompt(i), golden_params(case)) for i in range(2)]
    out.append(Job("spec:ouro-tiny", lambda p, path=case.path: path, requests,
                   {"block_size": 4, "speculative": {"num_tokens": 3, "draft_loops": 3}}))
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(1, 61, (n,), generator=gen).tolist() for n in (5, 11, 3)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    exiting = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, exit_threshold=0.4)
    mqa = lambda p: zoo.from_config(MQA_OURO, dtype="float32", seed=5, **p.shard_args())   # noqa: E731
    out.append(Job("mqa-replicated-kv", mqa, [(q, greedy) for q in prompts], {"block_size": 4}, [True] * 3))
    out.append(Job("early-exit-last-exited", mqa, [(q, exiting) for q in prompts],
                   {"block_size": 4, "kv_mode": "last_exited"}, [True] * 3))
    out.append(Job("early-exit-full", mqa, [(q, exiting) for q in prompts], {"block_size": 4}, [True] * 3))
    case = golden_case("huginn-tiny")
    seeded = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=1234, init_scale=1.0,
                            ignore_eos=True)
    unseeded = SamplingParams(max_tokens=8, temperature=1.0, init_scale=1.0, ignore_eos=True)
    requests = [(case.prompt(0), seeded), (case.prompt(1), unseeded), (case.prompt(2), seeded)]
    out.append(Job("huginn-sampled", lambda p, path=case.path: path, requests, {"block_size": 4},
                   [True, False, True]))
    return out


def run_job(job: Job, hal: Any, parallel: ParallelState) -> list[list[int]] | None:
    """Rank 0: the tokens of every request; other ranks: follow, None."""
    source = job.source(parallel)
    if not parallel.is_driver:
        follow(source, hal, "float32", parallel)
        return None
    llm = LLM(source, hal=hal, dtype="float32", parallel=parallel, max_num_seqs=4, **job.engine)
    outputs = llm.generate([prompt for prompt, _ in job.requests], [params for _, params in job.requests])
    llm.close()
    parallel.stop_followers()
    return [o.token_ids for o in outputs]


def cli_generate(world_size: int) -> list[list[int]]:
    """`runtime.generate` as torchrun runs it (its own process group from the environment)."""
    from hydra import compose, initialize_config_dir

    from runtime.generate import CONF_DIR, run

    case = golden_case("ouro-tiny")
    ids = [case.prompt(i) for i in range(case.num_prompts)]
    overrides = ["hal=cpu", f"model.path={case.path}", f"prompt_ids={ids}", "max_tokens=16",
                 "model.dtype=float32", "ignore_eos=true", "temperature=0", f"parallel.tp={world_size}"]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose("generate", overrides=overrides)
    return [r["token_ids"] for r in run(cfg)]


def main(out_path: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")        # one world group for every run below (each adds a control group)
    hal = hal_registry.get("cpu")
    parallel = init_distributed(hal, int(os.environ["WORLD_SIZE"]))
    try:
        big = {"ids": list(range(20_000)), "text": "x" * 5000}         # more than one control frame
        if parallel.is_driver:
            parallel.channel.send(big)
        elif parallel.channel.recv() != big:
            raise AssertionError("a large control message arrived changed")
        results = {job.name: run_job(job, hal, parallel) for job in jobs()}
    finally:
        parallel.shutdown()
    results["cli:ouro-tiny"] = cli_generate(parallel.world_size)
    dist.destroy_process_group()
    if parallel.is_driver:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
