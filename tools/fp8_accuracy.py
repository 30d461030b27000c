"""FP8 accuracy on the CPU: logit error and greedy agreement of FP8 KV, FP8 weights and both, against
float32, next to plain bf16 (docs/fp8.md has the tables this prints).

    PYTHONPATH=. python tools/fp8_accuracy.py [--out fp8_accuracy.json] [--subjects golden,ouro-tiny,real-shape]

Every configuration runs through the engine (paged KV, fused projections, the quantization exactly as
the runtime does it; FP8 emulated with torch's float8 dtypes). Per subject and configuration:
- logits, teacher-forced: the float32 run's prompt + greedy continuation goes through the model
  under test in one prefill (over its quantized cache); `mean/std` and `max/std` are the mean and
  largest |logit - float32 logit| over every position, divided by the float32 logits' standard
  deviation; `top-1` is the fraction of positions whose argmax equals float32's;
- greedy agreement: the engine generates N tokens; `agree` is the fraction of positions equal to
  float32's greedy tokens (a divergence usually changes everything after it), `first` the mean index
  of the first differing token (N when none differs).
W8A8 is the `torch._scaled_mm` path of hal/cuda/fp8.py (activations rounded to e4m3 per row): bf16
models run the real op (torch has it on the CPU), float32 ones its emulation. "W8A8 per 512-slice" is
the sm_90 one-row decode kernel's rounding (one activation scale per 512 values of K; lever 118),
emulated for every row.
Subjects: the four golden cases (tiny random models with deliberately sharp weights: a worst case);
ouro-tiny, the trained model shipped in the package (15.5M since issue 22), on text; Ouro-1.4B's real layer shape
(hidden 2048, 16 heads x 128, MLP 5632, vocab 49152) with random weights and 2 layers x 4 loops
(random logits are flat, so their greedy agreement says little; the logit errors are the point).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import hal  # noqa: E402
import zoo  # noqa: E402
from hal.cuda.fp8 import quantize_rows, scaled_mm_linear  # noqa: E402
from hal.kernels.configs import all_configs  # noqa: E402
from runtime import SamplingParams  # noqa: E402
from runtime.config import EngineConfig  # noqa: E402
from runtime.engine.llm_engine import LLMEngine  # noqa: E402
from runtime.execution.reference import CachedContext, forward_step  # noqa: E402
from hal.cpu import CpuHal  # noqa: E402

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
TEXT = ["A fool and his money", "In the beginning God created", "You will meet a tall dark stranger",
        "And the LORD said unto Moses", "The best way to predict the future is", "Blessed are the meek"]


class Config(NamedTuple):
    dtype: str                  # model dtype
    kv: str                     # EngineConfig.kv_dtype
    weights: str                # "auto" | "w8a16" | "w8a8"


CONFIGS = {
    "float32": Config("float32", "auto", "auto"),
    "bf16": Config("bfloat16", "auto", "auto"),
    "fp8 KV (e4m3fn)": Config("float32", "fp8_e4m3fn", "auto"),
    "fp8 KV (e4m3fnuz = MI300)": Config("float32", "fp8_e4m3fnuz", "auto"),
    "fp8 weights W8A16": Config("float32", "auto", "w8a16"),
    "fp8 weights W8A8": Config("float32", "auto", "w8a8"),
    "fp8 weights W8A8 per 512-slice": Config("float32", "auto", "w8a8s"),
    "fp8 KV + W8A16": Config("float32", "fp8_e4m3fn", "w8a16"),
    "bf16 + fp8 KV + W8A8 (H200 above 8 rows)": Config("bfloat16", "fp8_e4m3fn", "w8a8"),
    "bf16 + fp8 KV + W8A16 (H200 decode of 1-8 rows)": Config("bfloat16", "fp8_e4m3fn", "w8a16"),
    "bf16 + fp8 KV + W8A8 per 512-slice (sm_90 decode of 1 row)": Config("bfloat16", "fp8_e4m3fn", "w8a8s"),
}
SLICE_K = all_configs()["sm_90"]["gemv_slice_w8a8"].block_k      # one activation scale per SLICE_K values of K


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.dtype == torch.bfloat16:
        return scaled_mm_linear(x, weight, scale, bias)
    xq, x_scale = quantize_rows(x)
    y = (xq.float() * x_scale) @ (weight.float() * scale[:, None]).T
    return (y if bias is None else y + bias).to(x.dtype)


def w8a8_slices_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 as the one-row slice kernel rounds (hal/kernels/gemv_slice.py `A8`): each row's activations
    in slices of SLICE_K, each slice to e4m3 by its own absmax (every row here, whatever the batch)."""
    pad = -x.shape[-1] % SLICE_K
    parts = torch.nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, SLICE_K))   # [..., slices, SLICE_K]
    xq, x_scale = quantize_rows(parts.flatten(0, -2))
    xd = (xq.float() * x_scale).view(parts.shape).flatten(-2)[..., :x.shape[-1]]
    y = xd @ (weight.float() * scale[:, None]).T
    return (y if bias is None else y + bias).to(x.dtype)


class Subject(NamedTuple):
    name: str
    load: Any                   # dtype -> model
    prompts: list[list[int]]
    new_tokens: int
    sampling: dict[str, Any]    # extra SamplingParams fields


def subjects(names: list[str]) -> list[Subject]:
    out = []
    if "golden" in names:
        golden = ROOT / "tests" / "data" / "golden"
        from safetensors.torch import load_file

        for case in sorted(p for p in golden.iterdir() if (p / "golden.json").is_file()):
            meta = json.loads((case / "golden.json").read_text())
            tensors = load_file(str(case / "golden.safetensors"))
            prompts = [tensors[f"prompt_{i}"].tolist() for i in range(meta["num_prompts"])]
            extra = {"num_loops": meta.get("greedy_num_steps"), "init_scale": 0.0}
            out.append(Subject(case.name, lambda d, c=case: zoo.from_pretrained(c, dtype=d), prompts,
                               meta["greedy_new_tokens"], extra))
    if "ouro-tiny" in names:
        from runtime.text.tokenizer import Tokenizer
        from zoo.resolve import packaged_checkpoint

        folder = packaged_checkpoint("ouro-tiny")
        if folder is not None:
            tok = Tokenizer.from_folder(folder)         # the texts as LLM.generate feeds them (no BOS here)
            out.append(Subject("ouro-tiny (trained)", lambda d: zoo.from_pretrained(folder, dtype=d),
                               [tok.encode_prompt(t) for t in TEXT], 64, {}))
    if "real-shape" in names:
        config = json.loads((ROOT / "zoo" / "configs" / "ouro-1.4b.json").read_text()) | {"num_hidden_layers": 2}
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, config["vocab_size"], (48,), generator=gen).tolist() for _ in range(3)]
        out.append(Subject("Ouro-1.4B shape, 2 layers, random", lambda d: zoo.from_config(config, dtype=d, seed=0),
                           prompts, 24, {}))
    return out


class W8A8CpuHal(CpuHal):
    """The CPU Hal whose fp8_linear quantizes activations too (W8A8: per row as `torch._scaled_mm` does,
    or per slice of K as the sm_90 one-row kernel does)."""

    def __init__(self, linear=w8a8_linear):
        super().__init__()
        self.linear = linear

    def op(self, name: str):
        return self.linear if name == "fp8_linear" else super().op(name)


def run_config(subject: Subject, config: Config, forced: list[list[int]] | None) -> dict[str, Any]:
    """Greedy tokens through the engine, then the teacher-forced logits of `forced` (or of the
    greedy sequences themselves when None) through the same quantized model and cache rounding."""
    model = subject.load(config.dtype)
    weights = "auto" if config.weights == "auto" else "fp8"
    # W8A8: the CPU Hal with the activation-quantizing linear as its fp8_linear op (the engine binds it)
    w8a8 = {"w8a8": w8a8_linear, "w8a8s": w8a8_slices_linear}.get(config.weights)
    device_hal = W8A8CpuHal(w8a8) if w8a8 is not None else hal.get("cpu")
    longest = max(map(len, subject.prompts)) + subject.new_tokens + 1
    engine = LLMEngine(model, device_hal, EngineConfig(
        kv_dtype=config.kv, weights_dtype=weights, max_num_seqs=len(subject.prompts), max_model_len=longest))
    params = SamplingParams(max_tokens=subject.new_tokens, temperature=0.0, ignore_eos=True, **subject.sampling)
    for i, prompt in enumerate(subject.prompts):
        engine.add_request(str(i), prompt, params)
    done = {o.request_id: o.token_ids for o in engine.run_until_done()}
    greedy = [done[str(i)] for i in range(len(subject.prompts))]
    kv_dtype = engine.runner.backend.kv_dtype if config.kv != "auto" else None
    sequences = forced or [p + g for p, g in zip(subject.prompts, greedy)]
    logits = []
    for ids in sequences:
        ctx = CachedContext(None, subject.sampling.get("init_scale"), kv_dtype, engine.runner.ops)
        ctx.begin_step(torch.arange(len(ids))[None])
        loops = subject.sampling.get("num_loops") or model.default_num_loops
        logits.append(forward_step(model, torch.tensor(ids), ctx, loops, 1.0)[0])
    return {"greedy": greedy, "logits": logits, "sequences": sequences}


def compare(subject: Subject, got: dict[str, Any], ref: dict[str, Any]) -> dict[str, float]:
    errs, tops, agree, first = [], [], [], []
    for i, prompt in enumerate(subject.prompts):
        out, want = got["logits"][i][len(prompt) - 1:], ref["logits"][i][len(prompt) - 1:]   # predicted rows
        diff, std = (out - want).abs(), want.std().item()
        errs.append((diff.mean().item() / std, diff.max().item() / std))
        tops.append((out.argmax(-1) == want.argmax(-1)).float().mean().item())
        g, r = got["greedy"][i], ref["greedy"][i]
        agree.append(sum(a == b for a, b in zip(g, r)) / len(r))
        first.append(next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), len(r)))
    n = len(errs)
    return {"mean/std": sum(e[0] for e in errs) / n, "max/std": max(e[1] for e in errs),
            "top-1": sum(tops) / n, "agree": sum(agree) / n, "first": sum(first) / n}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--subjects", default="golden,ouro-tiny,real-shape")
    parser.add_argument("--configs", default=",".join(CONFIGS),       # names hold no commas
                        help="comma-separated names of " + ", ".join(CONFIGS))
    parser.add_argument("--out", default="", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    rows = []
    print("| subject | configuration | logit mean/std | logit max/std | top-1 (forced) | greedy agree "
          "| first diff |")
    print("|---|---|---|---|---|---|---|")
    for subject in subjects(args.subjects.split(",")):
        start = time.time()
        ref = run_config(subject, CONFIGS["float32"], None)
        for name in args.configs.split(","):
            if name == "float32":
                continue
            stats = compare(subject, run_config(subject, CONFIGS[name], ref["sequences"]), ref)
            rows.append({"subject": subject.name, "config": name, **stats})
            print(f"| {subject.name} | {name} | {stats['mean/std']:.4f} | {stats['max/std']:.3f} | "
                  f"{stats['top-1']:.3f} | {stats['agree']:.3f} | {stats['first']:.1f} / {subject.new_tokens} |",
                  flush=True)
        print(f"<!-- {subject.name}: {time.time() - start:.0f} s -->", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
