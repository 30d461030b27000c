"""Which library kernels of a captured graph may take a programmatic edge: an experiment on the GPU.

    PYTHONPATH=. python tools/graph_pdl_probe.py [--chain] [--out rows.jsonl]
    PYTHONPATH=. python tools/graph_pdl_probe.py --variants ouro-1.4b:qkv:m64,...   # the harness's variants

Why: making the edges into library kernels (cuBLAS, cuDNN) programmatic (tools/graph_edges.py) would
let them launch under their predecessor as our PDL kernels do; that is only safe for a kernel that runs
`griddepcontrol.wait` (SASS `ACQBULK`) before reading its input. Rows:
- `kernels`: every library kernel that `F.linear` puts into a captured graph at the engine's decode
  buckets and prefill widths (Ouro-1.4B, Nanbeige4.2-3B, Huginn-0125 projections and lm_heads), and
  the fresh prefill attention (cuDNN), with the first case that launches it;
- `race`, one per kernel: its input is filled with NaN, then written by a kernel that lets its
  dependents launch and writes only after 30 us; with the edge into the library kernel made
  programmatic, a kernel that does not wait reads NaN. The writer runs few programs (16 KiB each):
  one program per SM (1 KiB each) kept cuBLAS's clustered kernels off the SMs until the writer ended,
  which hid the missing wait (`--variants` shows it). `control`: the same into torch's elementwise
  kernel, which does not wait, must read NaN;
- `verdict`: the kernels that waited and those that did not, with the library versions;
- `chain` (with --chain): a layer loop of (a small PDL kernel, a projection) at batch 1 and 64, the
  graph as captured and with the edges into waiting kernels programmatic: us per layer.
(The `sass` row in docs/data/h200-s28-graph-pdl.jsonl came from a `--sass` mode, cuobjdump's counts,
whose function was never committed: the flag, which could only fail, is gone.)
"""
from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pdl_bench import MODEL_SHAPES  # noqa: E402

import graph_edges  # noqa: E402
from hal.cuda.driver import loaded_library  # noqa: E402
from runtime.execution.graphs import DEFAULT_BUCKETS  # noqa: E402
from runtime.execution.prefill_buckets import LONG, MEDIUM, SHORT  # noqa: E402

VOCAB = {"ouro-1.4b": 49152, "nanbeige4.2-3b": 166144, "huginn-0125": 65536}
OURS = re.compile(r"^(_late_copy|_pdl_copy)|at::|void at_|^triton_")


@triton.jit
def _late_copy(src, dst, n, delay_ns, BLOCK: tl.constexpr):
    """Let the next kernel launch, wait `delay_ns`, then copy: a dependent that does not wait
    reads `dst` before it is written."""
    tl.extra.cuda.gdc_launch_dependents()
    start = tl.extra.cuda.globaltimer()
    while tl.extra.cuda.globaltimer() - start < delay_ns:
        pass
    tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _pdl_copy(src, src_stride, dst, n, k, BLOCK: tl.constexpr):
    """A norm-sized kernel launched with PDL, as the engine's kernels between projections are: the
    first `k` columns of `src` into `dst` ([rows, k])."""
    tl.extra.cuda.gdc_launch_dependents()
    tl.extra.cuda.gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    value = tl.load(src + (offs // k) * src_stride + offs % k, mask=offs < n)
    tl.store(dst + offs, value, mask=offs < n)


def capture(fn, rewrite=None):
    """(graph, Rewrite or None): `fn` captured; `rewrite` a name predicate for the edges to convert."""
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        fn()
    result = graph_edges.make_programmatic(graph.raw_cuda_graph(), rewrite) if rewrite else None
    graph.instantiate()
    return graph, result


def names_of(fn) -> list[str]:
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        fn()
    return list(graph_edges.kernel_names(graph.raw_cuda_graph()).values())


class Case(NamedTuple):
    label: str
    src: torch.Tensor                                  # the input's values
    op: Callable[[torch.Tensor], torch.Tensor]         # reads a buffer shaped like `src`


def products(model):
    """(name, N, K) of the model's projections, the lm_head's too (and Huginn's adapter)."""
    hidden = MODEL_SHAPES[model][0][2]
    extra = [("lm_head", VOCAB[model], hidden)]
    if model == "huginn-0125":
        extra.append(("adapter", hidden, 2 * hidden))
    return list(MODEL_SHAPES[model]) + extra


def linear_cases(models):
    """F.linear at every decode bucket and prefill width the engine captures (lm_head: decode rows only)."""
    for model in models:
        for name, n, k in products(model):
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
            for m in DEFAULT_BUCKETS + (() if name == "lm_head" else SHORT + MEDIUM + LONG[:1]):
                yield Case(f"{model}:{name}:m{m}", torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                           lambda x, w=w: F.linear(x, w))


def attention_cases():
    """The fresh prefill attention (hal/kernels/fresh.py, cuDNN) over one packed q|k|v buffer."""
    from hal.kernels.fresh import attention
    for heads, kv_heads in ((16, 16), (48, 8)):
        for t in MEDIUM + LONG[:1]:
            qkv = torch.randn(t, heads + 2 * kv_heads, 128, device="cuda", dtype=torch.bfloat16)
            starts = torch.tensor([0, t], device="cuda", dtype=torch.int32)

            def op(x, t=t, heads=heads, kv_heads=kv_heads, starts=starts):
                q, k, v = x.split([heads, kv_heads, kv_heads], dim=1)
                return attention("cudnn", q, k, v, starts, [t], 128 ** -0.5)
            yield Case(f"attention:h{heads}/{kv_heads}:t{t}", qkv, op)


def library_kernels(cases):
    """Library kernel name -> the first case that launches it, and every label that does."""
    first, labels = {}, {}
    for case in cases:
        case.op(case.src)
        for name in names_of(lambda: case.op(case.src)):
            if not OURS.search(name):
                first.setdefault(name, case)
                labels.setdefault(name, []).append(case.label)
        torch.cuda.synchronize()
    return first, labels


def race_row(case, target, typed=False, block=16384, delay_ns=30_000):
    """Edges into kernel `target` made programmatic after a kernel that writes `op`'s input late
    (`typed`: the NaN fill and the copy in the input's dtype, else in bytes)."""
    x = torch.empty_like(case.src)
    expect = case.op(case.src)
    out = torch.empty_like(expect)
    src_flat, x_flat = case.src.view(-1), x.view(-1)
    if not typed:
        src_flat, x_flat = src_flat.view(torch.uint8), x_flat.view(torch.uint8)

    def step():
        if typed:
            x_flat.fill_(float("nan"))
        else:
            x_flat.fill_(255)                                # NaN in bf16 and in float8_e4m3fn
        _late_copy[(triton.cdiv(src_flat.numel(), block),)](src_flat, x_flat, src_flat.numel(), delay_ns,
                                                           BLOCK=block, launch_pdl=True)
        out.copy_(case.op(x))

    step()
    torch.cuda.synchronize()
    graph, rewrite = capture(step, lambda name: name == target)
    worst, nans = 0.0, 0
    for _ in range(5):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        nans += int(out.isnan().any())
        worst = max(worst, float((out.float() - expect.float()).abs().nan_to_num(float("inf")).max()))
    return {"row": "race", "kernel": target, "case": case.label, "converted": rewrite.num_converted,
            "typed": typed, "block": block, "delay_ns": delay_ns, "replays_with_nan": nans,
            "max_abs_err": worst, "waits": rewrite.num_converted > 0 and nans == 0 and worst == 0.0}


def control_row():
    """torch's elementwise kernel does not wait: the same race must read NaN there."""
    case = Case("control:mul", torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16), lambda x: x * 2)
    names = [n for n in names_of(lambda: case.op(case.src)) if "elementwise" in n]
    return {**race_row(case, names[0]), "row": "control"}


def library_versions():
    lib = ctypes.CDLL(loaded_library("libcublasLt"))
    lib.cublasLtGetVersion.restype = ctypes.c_size_t
    return {"cublasLt": int(lib.cublasLtGetVersion()), "cudnn": torch.backends.cudnn.version(),
            "torch": torch.__version__, "device": torch.cuda.get_device_name()}


def chain_row(model, m, layers, waits):
    dims = MODEL_SHAPES[model]
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _, n, k in dims]
               for _ in range(layers)]
    hidden = dims[0][2]
    x0 = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    buffers = [torch.empty(m, k, device="cuda", dtype=torch.bfloat16) for _, _, k in dims]
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _, n, _ in dims]

    def step():
        x = x0
        for layer in weights:
            for j, ((_, n, k), w) in enumerate(zip(dims, layer)):
                staged = buffers[j]
                _pdl_copy[(triton.cdiv(m * k, 1024),)](x, x.stride(0), staged, m * k, k, BLOCK=1024,
                                                       launch_pdl=True)
                F.linear(staged, w, out=outs[j])
                x = outs[j]
        return x

    step()
    torch.cuda.synchronize()
    times = {}
    for label, predicate in (("as_captured", None), ("programmatic", waits)):
        graph, rewrite = capture(step, predicate)
        graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1000 / 20 / layers)
        times[label] = sorted(samples)[len(samples) // 2]
        if rewrite:
            times["converted"] = rewrite.num_converted
            times["edges"] = rewrite.num_edges
    return {"row": "chain", "model": model, "m": m, "layers": layers, "us_per_layer": times}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="ouro-1.4b,nanbeige4.2-3b,huginn-0125")
    parser.add_argument("--chain", action="store_true", help="also time the layer chains")
    parser.add_argument("--variants", default=None, help="comma-separated case labels: race each library "
                                                          "kernel of these cases under each harness variant")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.variants:
        wanted = args.variants.split(",")
        cases = [c for c in linear_cases(args.models.split(",")) if c.label in wanted]
        for case in cases:
            first, _ = library_kernels([case])
            for name in first:
                for typed, block, delay in ((True, 1024, 30_000), (False, 16384, 30_000),
                                            (True, 1024, 200_000), (False, 1024, 30_000), (True, 16384, 30_000)):
                    _write([race_row(case, name, typed, block, delay)], args.out)
        return
    first, labels = library_kernels([*linear_cases(args.models.split(",")), *attention_cases()])
    _write([{"row": "kernels", **library_versions(),
             "names": {name: {"first": cases[0], "cases": len(cases)} for name, cases in labels.items()}}],
           args.out)
    races = [race_row(case, name) for name, case in first.items()]
    _write(races + [control_row()], args.out)
    waiting = sorted(r["kernel"] for r in races if r["waits"])
    _write([{"row": "verdict", **library_versions(), "wait": waiting,
             "no_wait": sorted(r["kernel"] for r in races if not r["waits"])}], args.out)
    if args.chain:
        waits = graph_edges.name_matcher("^(" + "|".join(map(re.escape, waiting)) + ")$")
        for model, m, layers in (("nanbeige4.2-3b", 1, 22), ("ouro-1.4b", 1, 24), ("ouro-1.4b", 64, 24)):
            _write([chain_row(model, m, layers, waits)], args.out)


def _write(rows, out):
    """Print each row (the kernel list indented) and append it to `out`."""
    for row in rows:
        print(json.dumps(row, indent=1 if row["row"] == "kernels" else None), flush=True)
        if out:
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
