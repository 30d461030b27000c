"""The host's part of one long prompt's captured prefill step, on the CPU: everything `engine.step()`
does for a prompt of N tokens except the device work (scheduling and block allocation, the step's
inputs, the attention metadata, sampling's bookkeeping, the release of the blocks when the request
ends after its one token).

    python tools/prefill_host_cost.py [--model ouro-1.4b] [--tokens 8192] [--repeats 20]

Why: `runtime.bench`'s 8k cell times the whole step, host included, and on the GPU a profile cannot
tell the host's lead from the kernels'. Here the model keeps the real one's planes (loops, KV
layout, block size) at one narrow layer, the runner takes the captured-prefill path it takes on a
GPU (`PrefillBuckets` with capture on), and the replay does nothing, so what is left is host time.
The CPU Hal's attention metadata is the reference backend's; the CUDA Hal's (the Triton backend's
`update_meta`, pinned staging of the tables and slots) is timed on its own after it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import hal
import zoo
from hal.attention import MetaCapacity, PagedBatch
from hal.common.graph import EagerGraph
from hal.kernels.backend import TritonPagedAttention
from hal.kernels.configs import configs_for
from runtime.config import EngineConfig
from runtime.engine.llm_engine import LLMEngine
from runtime.engine.planes import PlaneLayout
from runtime.execution.prefill_buckets import PrefillBuckets
from runtime.sampling_params import SamplingParams

CONFIGS = Path(__file__).resolve().parent.parent / "zoo" / "configs"


def narrow_model(name: str, max_len: int):
    """The model's config at width 64 (two heads of 32), one layer (Huginn: its prelude, core block
    and coda as they are): the same planes and loops."""
    config = json.loads((CONFIGS / f"{name}.json").read_text())
    if "n_embd" in config:      # Huginn's own names; its token ids stay in its vocabulary
        config.update(n_embd=64, n_heads=2, intermediate_size=128, block_size=max_len)
    else:
        config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=max_len)
    path = Path(tempfile.mkdtemp()) / "config.json"
    path.write_text(json.dumps(config))
    return zoo.from_config(path, dtype="float32", device=torch.device("cpu"), seed=0)


def num_planes(model) -> int:
    """The KV planes one request of the model's default depth owns (kv_mode full)."""
    return PlaneLayout("full", model.kv_spec.num_fixed_planes).num_planes(model.default_num_loops)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="ouro-1.4b", choices=sorted(p.stem for p in CONFIGS.glob("*.json")))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    model = narrow_model(args.model, args.tokens + 64)
    planes = num_planes(model)
    config = EngineConfig(max_num_seqs=1, max_model_len=args.tokens + 32, max_num_batched_tokens=args.tokens,
                          num_kv_blocks=planes * (args.tokens // 16 + 3))
    engine = LLMEngine(model, hal.get("cpu"), config)
    engine.runner.prefill_buckets = PrefillBuckets(args.tokens, captures=True)    # the GPU's path
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    prompts = iter(range(1 << 30))

    def one_prompt() -> tuple[float, float]:
        """(ms in add_request, ms in the steps until the request is done)"""
        prompt = torch.randint(1, 500, (args.tokens,), generator=gen).tolist()
        start = time.perf_counter()
        engine.add_request(f"p{next(prompts)}", prompt, params)
        added = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return (added - start) * 1e3, (time.perf_counter() - added) * 1e3

    one_prompt()                                  # the capture (here: the eager warm-up) runs once
    EagerGraph.replay = lambda self: None         # from here on, no device work at all
    add_ms, step_ms = (statistics.median(t) for t in zip(*(one_prompt() for _ in range(args.repeats))))
    print(f"{args.model}: one {args.tokens}-token prompt, {planes} planes of {args.tokens // 16} blocks, medians "
          f"of {args.repeats}: add_request {add_ms:.3f} ms (before runtime.bench's clock starts), then the step "
          f"to the finished output {step_ms:.3f} ms")
    backend = TritonPagedAttention(16, 16, 128, torch.bfloat16, torch.device("cpu"), 16, configs_for("default"),
                                   num_compute_units=132, fresh_attention="cudnn")
    blocks = -(-args.tokens // 16)
    batch = PagedBatch([args.tokens], [args.tokens],
                       [[list(range(p * blocks, (p + 1) * blocks))] for p in range(planes)], 16)
    meta = backend.build_meta(batch, MetaCapacity(1, args.tokens, blocks + 8, planes, args.tokens + 64, True))
    print(f"the Triton backend's update_meta for it: {median_ms(lambda: backend.update_meta(meta, batch), 50):.3f} ms")


if __name__ == "__main__":
    main()
