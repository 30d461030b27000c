"""Priority scheduling, the RFC's experiment: 64 low-priority requests fill the engine, then 8
high-priority ones arrive; 16 slots. Reports each class's median completion time (from the start,
in seconds and in engine steps) under `scheduling_policy=fcfs` and `priority`.

    python examples/priority_experiment.py     # the auto Hal: on a GPU Ouro-1.4B's shape with random
                                               # bf16 weights; on the CPU a small random Ouro (minutes)

The RFC saw the high class's median fall from 7.80 s to 2.22 s on its GPU. Under FCFS the late
high-priority requests queue behind every low one; under the priority policy they preempt the
newest low-priority requests at once and run to completion, and the low class pays a little.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

import hal as hal_registry
import zoo
from runtime import SamplingParams
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine

SMALL_OURO = {"model_type": "ouro", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16,
              "total_ut_steps": 4, "max_position_embeddings": 256, "rope_theta": 10000.0, "eos_token_id": 0}


class Completion(NamedTuple):
    seconds: float
    steps: int


def run_experiment(model: Any, hal: Any, policy: str, num_low: int = 64, num_high: int = 8,
                   num_slots: int = 16, prompt_len: int = 16, max_tokens: int = 32,
                   high_arrival_step: int = 4, seed: int = 0,
                   **engine_options: Any) -> dict[str, list[Completion]]:
    """Completion (time and step since the start) of every request, by class (`engine_options`: more
    `EngineConfig` fields)."""
    config = EngineConfig(max_num_seqs=num_slots, scheduling_policy=policy,
                          max_num_batched_tokens=num_slots * prompt_len, **engine_options)
    engine = LLMEngine(model, hal, config)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    def prompt() -> list[int]:
        return torch.randint(1, vocab, (prompt_len,), generator=gen).tolist()

    for i in range(num_low):
        engine.add_request(f"low-{i}", prompt(), params, priority=1)
    done: dict[str, list[Completion]] = {"low": [], "high": []}
    start, step = time.monotonic(), 0
    with torch.inference_mode():
        while engine.has_unfinished_requests() or step <= high_arrival_step:
            if step == high_arrival_step:
                for i in range(num_high):
                    engine.add_request(f"high-{i}", prompt(), params, priority=0)
            step += 1
            for out in engine.step():
                if out.finished:
                    done[out.request_id.split("-")[0]].append(Completion(time.monotonic() - start, step))
    return done


def summary(done: dict[str, list[Completion]]) -> dict[str, float]:
    return {f"{cls}_median_{unit}": round(statistics.median(getattr(c, unit) for c in items), 3)
            for cls, items in done.items() for unit in ("seconds", "steps")}


def main() -> None:
    hal = hal_registry.get("auto")
    if hal.name == "cpu":
        model = zoo.from_config(SMALL_OURO, dtype="float32", seed=0)
    else:
        config = Path(__file__).resolve().parents[1] / "zoo" / "configs" / "ouro-1.4b.json"
        model = zoo.from_config(config, dtype="bfloat16", device=hal.device(), seed=0)
    for policy in ("fcfs", "priority"):
        row = {"policy": policy, "hal": hal.name, **summary(run_experiment(model, hal, policy))}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
