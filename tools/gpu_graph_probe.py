"""Which captured piece goes stale? Each probe captures one piece with the CUDA Hal's graphs, changes
its inputs in place, replays, and prints the max difference to the same piece run eagerly."""
from __future__ import annotations

import traceback

import torch

import hal
from hal.base import MetaCapacity, PagedBatch


def probe(name, fn):
    try:
        print(f"{name}: {fn()}", flush=True)
    except Exception:
        print(f"{name}: FAILED\n{traceback.format_exc(limit=4)}", flush=True)


def main() -> None:
    gpu = hal.get("cuda")
    dev = gpu.device()
    torch.manual_seed(0)

    def embedding():
        table = torch.randn(1000, 64, device=dev)
        ids = torch.zeros(4, dtype=torch.long, device=dev)
        fn = lambda: torch.nn.functional.embedding(ids, table) * 2       # noqa: E731
        fn()
        g = gpu.graph()
        out = g.capture(fn)
        ids.copy_(torch.tensor([5, 7, 9, 11]))
        g.replay()
        return (out - fn()).abs().max().item()

    def fused_ops():
        x = torch.randn(4, 2048, device=dev, dtype=torch.bfloat16)
        w = torch.randn(2048, device=dev, dtype=torch.bfloat16)
        r = torch.randn(4, 2048, device=dev, dtype=torch.bfloat16)
        op = gpu.op("rms_norm")
        fn = lambda: op(x, w, 1e-6, r)                                   # noqa: E731
        fn()
        g = gpu.graph()
        out = g.capture(fn)
        x.copy_(torch.randn(4, 2048, device=dev))
        g.replay()
        return (out.float() - fn().float()).abs().max().item()

    def attention():
        backend = gpu.attention(16, 16, 128, torch.bfloat16)
        cache = torch.randn(backend.kv_cache_shape(64), device=dev, dtype=torch.bfloat16)
        pad = PagedBatch([1, 1], [1, 1], [[[63], [63]]], 16)
        real = PagedBatch([1, 1], [40, 17], [[[3, 4, 5], [9, 10]]], 16)
        meta = backend.build_meta(pad, MetaCapacity(2, 2, 8, 1, 128))
        q = torch.randn(2, 16, 128, device=dev, dtype=torch.bfloat16)
        fn = lambda: backend.forward(q, cache, meta, 0, 0.088)           # noqa: E731
        fn()
        g = gpu.graph()
        out = g.capture(fn)
        backend.update_meta(meta, real)
        g.replay()
        eager = backend.forward(q, cache, backend.build_meta(real), 0, 0.088)
        return (out.float() - eager.float()).abs().max().item()

    def kv_write():
        backend = gpu.attention(16, 16, 128, torch.bfloat16)
        cache = torch.zeros(backend.kv_cache_shape(64), device=dev, dtype=torch.bfloat16)
        pad = PagedBatch([1, 1], [1, 1], [[[63], [63]]], 16)
        real = PagedBatch([1, 1], [40, 17], [[[3, 4, 5], [9, 10]]], 16)
        meta = backend.build_meta(pad, MetaCapacity(2, 2, 8, 1, 128))
        k = torch.randn(2, 16, 128, device=dev, dtype=torch.bfloat16)
        fn = lambda: backend.write_kv(k, k, cache, meta, 0)              # noqa: E731
        fn()
        g = gpu.graph()
        g.capture(fn)
        backend.update_meta(meta, real)
        g.replay()
        torch.cuda.synchronize()
        got = cache[0, 5, 39 - 32].float()
        return (got - k[0].float()).abs().max().item()

    probe("embedding", embedding)
    probe("fused rms_norm", fused_ops)
    probe("attention (meta updated in place)", attention)
    probe("kv_write (meta updated in place)", kv_write)


if __name__ == "__main__" and not __import__("sys").argv[1:]:
    main()


def decode_step_bisect() -> None:
    """A 2-layer Ouro-1.4B-shaped engine: one decode step through a captured DecodeGraphs and through
    the eager padded path, on the same requests; then the captured prelude and each loop alone."""
    import json
    from pathlib import Path

    import zoo
    from runtime.config import EngineConfig, SamplingParams
    from runtime.engine.llm_engine import LLMEngine
    from runtime.execution.graphs import DecodeGraphs

    gpu = hal.get(__import__("os").environ.get("PROBE_HAL", "cuda"))
    config = json.loads((Path(__file__).resolve().parent.parent / "zoo/configs/ouro-1.4b.json").read_text())
    config["num_hidden_layers"] = 2
    model = zoo.from_config(config, dtype="bfloat16", device=gpu.device(), seed=0)
    engine = LLMEngine(model, gpu, EngineConfig(graphs=False, max_num_seqs=4, max_model_len=256))
    for i in range(3):
        engine.add_request(str(i), list(range(5 + 7 * i, 40 + 9 * i)), SamplingParams(max_tokens=50, temperature=0))
    engine.step()                                        # prefill: every request gets a first token
    plan = engine.scheduler.schedule()
    runner = engine.runner
    eager_graphs, captured = runner.graphs, DecodeGraphs(runner, 4, 256, capture=True)
    with torch.inference_mode():
        got = captured.run(plan.scheduled, engine.blocks).clone()
        want = eager_graphs.run(plan.scheduled, engine.blocks).clone()
    print(f"decode step logits: captured vs eager max diff {(got - want).abs().max().item():.3e}; "
          f"argmax {got.argmax(-1).tolist()} vs {want.argmax(-1).tolist()}", flush=True)
    cap = next(iter(captured.graphs.values()))
    print(f"  captured ids {cap.ids.tolist()} positions {cap.positions.tolist()}", flush=True)
    meta = cap.ctx.meta
    print(f"  meta seq_lens {meta.seq_lens.tolist()} qsl {meta.query_start_loc.tolist()} "
          f"slots {meta.slot_mapping[:, :4].tolist()}", flush=True)


if __name__ == "__main__" and __import__("sys").argv[1:] == ["bisect"]:
    probe("decode step bisect", decode_step_bisect)


def multi_step() -> None:
    """Two engines on one 2-layer model, graphs captured vs the same padded path eager: tokens step by step."""
    import json
    import os
    from pathlib import Path

    import zoo
    from runtime.config import EngineConfig, SamplingParams
    from runtime.engine.llm_engine import LLMEngine

    gpu = hal.get(os.environ.get("PROBE_HAL", "cuda"))
    config = json.loads((Path(__file__).resolve().parent.parent / "zoo/configs/ouro-1.4b.json").read_text())
    config["num_hidden_layers"] = 2
    model = zoo.from_config(config, dtype="bfloat16", device=gpu.device(), seed=0)
    engines = {g: LLMEngine(model, gpu, EngineConfig(graphs=g, max_num_seqs=8, max_model_len=256)) for g in (False, True)}
    for g, engine in engines.items():
        for i in range(5):
            engine.add_request(str(i), list(range(5 + 7 * i, 40 + 9 * i)),
                               SamplingParams(max_tokens=6 + 2 * i, temperature=0, ignore_eos=True))
    for step in range(20):
        outs = {}
        for g, engine in engines.items():
            if engine.has_unfinished_requests():
                outs[g] = sorted((o.request_id, o.token_ids[-1]) for o in engine.step())
        print(f"step {step}: eager {outs.get(False)} | captured {outs.get(True)}", flush=True)
        if not outs:
            break


if __name__ == "__main__" and __import__("sys").argv[1:] == ["multi"]:
    probe("multi step", multi_step)


def patch_variant(name: str) -> None:
    import torch

    from hal.cuda import graph as cuda_graph
    from hal.kernels import backend as triton_backend
    from runtime.execution import graphs

    if name == "sync-before-replay":
        replay = cuda_graph.CudaGraph.replay

        def synced(self):
            torch.cuda.current_stream().synchronize()
            replay(self)
        cuda_graph.CudaGraph.replay = synced
    if name == "replay-on-capture-stream":
        def on_stream(self):
            current = torch.cuda.current_stream()
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                self.graph.replay()
            current.wait_stream(self.stream)
        cuda_graph.CudaGraph.replay = on_stream
    if name == "blocking-copies":
        update = triton_backend.TritonPagedAttention.update_meta

        def blocking(self, meta, batch):
            out = update(self, meta, batch)
            torch.cuda.current_stream().synchronize()
            return out
        triton_backend.TritonPagedAttention.update_meta = blocking


if __name__ == "__main__" and __import__("sys").argv[1:2] == ["variant"]:
    import sys

    patch_variant(sys.argv[2])
    probe(f"multi step ({sys.argv[2]})", multi_step)
