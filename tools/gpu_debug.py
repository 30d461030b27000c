"""Debug runs on the GPU: each case in its own process (a device-side assert ends a process) with
CUDA_LAUNCH_BLOCKING=1, printing tokens vs golden or graph vs eager, or the traceback.

    python tools/gpu_debug.py            # all cases
    python tools/gpu_debug.py CASE ...   # some
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "data" / "golden"
CASES = {
    "golden-fp32-eager": dict(kind="golden", dtype="float32", graphs=False),
    "golden-fp32-graphs": dict(kind="golden", dtype="float32", graphs=True),
    "golden-fp32-graphs-nofused": dict(kind="golden", dtype="float32", graphs=True, fused=False),
    "ouro2l-bf16-graphs": dict(kind="real", model="ouro-1.4b", layers=2, graphs=True),
    "ouro2l-bf16-graphs-nofused": dict(kind="real", model="ouro-1.4b", layers=2, graphs=True, fused=False),
    "ouro2l-bf16-eager": dict(kind="real", model="ouro-1.4b", layers=2, graphs=False),
    "nanbeige2l-bf16-graphs": dict(kind="real", model="nanbeige4.2-3b", layers=2, graphs=True),
    "ouro2l-graphs-unfused": dict(kind="real", model="ouro-1.4b", layers=2, graphs=True, fuse=False),
    "ouro2l-graphs-default-stream": dict(kind="real", model="ouro-1.4b", layers=2, graphs=True, patch="stream"),
    "ouro2l-graphs-warm-on-stream": dict(kind="real", model="ouro-1.4b", layers=2, graphs=True, patch="warm"),
    "ouro2l-graphs-sync": dict(kind="real", model="ouro-1.4b", layers=2, graphs=True, patch="sync"),
    "huginn2-graphs": dict(kind="real", model="huginn-0125", layers=None, graphs=True),
}


def apply_patch(name: str | None) -> None:
    """Variations of graph capture, to bisect a capture-only failure."""
    import torch

    from hal.cuda import graph as cuda_graph
    from runtime.execution import graphs

    if name in ("stream", "warm"):
        def capture(self, fn):
            with torch.cuda.device(self.device):
                if name == "warm":
                    self.stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(self.stream):
                        fn()
                    torch.cuda.current_stream().wait_stream(self.stream)
                with torch.cuda.graph(self.graph, pool=self.pool,
                                      stream=None if name == "stream" else self.stream):
                    self.outputs = fn()
            self.is_captured = True
            return self.outputs
        cuda_graph.CudaGraph.capture = capture
    if name == "sync":
        run = graphs.DecodeGraphs.run

        def synced(self, scheduled, blocks):
            torch.cuda.synchronize()
            out = run(self, scheduled, blocks)
            torch.cuda.synchronize()
            return out
        graphs.DecodeGraphs.run = synced


def run_case(spec: dict) -> None:
    import torch

    import hal
    import zoo
    from runtime.config import EngineConfig, SamplingParams
    from runtime.engine.llm_engine import LLMEngine

    gpu = hal.get("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    if spec["kind"] == "golden":
        for case in sorted(p for p in GOLDEN.iterdir() if (p / "golden.json").is_file()):
            from safetensors.torch import load_file

            meta = json.loads((case / "golden.json").read_text())
            tensors = load_file(str(case / "golden.safetensors"))
            model = zoo.from_pretrained(case, dtype=spec["dtype"], device=gpu.device())
            engine = LLMEngine(model, gpu, EngineConfig(graphs=spec["graphs"], max_num_batched_tokens=16))
            params = SamplingParams(max_tokens=meta["greedy_new_tokens"], temperature=0.0, ignore_eos=True,
                                    num_loops=meta.get("greedy_num_steps"), init_scale=0.0)
            for i in range(meta["num_prompts"]):
                engine.add_request(str(i), tensors[f"prompt_{i}"].tolist(), params)
            outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
            ok = [outs[str(i)] == tensors[f"greedy_{i}"].tolist() for i in range(meta["num_prompts"])]
            print(f"  {case.name}: greedy == golden {ok}", flush=True)
            if not all(ok):
                for i in range(meta["num_prompts"]):
                    print(f"    got  {outs[str(i)]}\n    want {tensors[f'greedy_{i}'].tolist()}")
    else:
        apply_patch(spec.get("patch"))
        config = json.loads((ROOT / "zoo" / "configs" / f"{spec['model']}.json").read_text())
        if spec["layers"]:
            config["num_hidden_layers"] = spec["layers"]
        model = zoo.from_config(config, dtype="bfloat16", device=gpu.device(), seed=0)
        engine = LLMEngine(model, gpu, EngineConfig(graphs=spec["graphs"], max_num_seqs=8, max_model_len=512,
                                                    fuse_projections=spec.get("fuse", True)))
        gen = torch.Generator().manual_seed(0)
        for i in range(5):
            prompt = torch.randint(1, config["vocab_size"], (int(torch.randint(4, 100, (1,), generator=gen)),),
                                   generator=gen).tolist()
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        outs = {o.request_id: o.token_ids for o in engine.run_until_done()}
        print(f"  tokens: {[outs[str(i)] for i in range(5)]}", flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        spec = CASES[sys.argv[2]]
        if spec.get("fused") is False:
            os.environ["LOOPSTACK_FUSED_OPS"] = "0"
        try:
            run_case(spec)
        except Exception:
            traceback.print_exc()
            sys.exit(1)
        return
    names = sys.argv[1:] or list(CASES)
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "PYTHONPATH": f"{os.environ.get('PYTHONPATH', '')}:{ROOT}"}
    for name in names:
        print(f"=== {name}", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--child", name], env=env, capture_output=True,
                              text=True, timeout=240)
        lines = [l for l in (proc.stdout + proc.stderr).splitlines()
                 if "Indexing.cu" not in l and not l.startswith("frame #")]
        print("\n".join(lines[-30:]), flush=True)
        print(f"--- {name}: rc={proc.returncode}", flush=True)


if __name__ == "__main__":
    main()
