"""GPU timings of every hal/kernels kernel at the Ouro-1.4B shapes (16 heads, 16 KV heads, head dim
128, hidden 2048, intermediate 5632, bf16; 4 planes x 24 layers = 96 attention calls per step).

    PYTHONPATH=. python tools/kernel_bench.py [--sweep]      # on the GPU (--sweep: + config sweep)

One line per cell: eager time (`do_bench`, includes launch overhead), graph time (the same calls
captured in one CUDA/HIP graph: also proves the launches capture), achieved GB/s and TFLOP/s, and the
floor = max(bytes / copy bandwidth, FLOPs / matmul rate) with both ceilings measured at start.
Attention cells rotate over enough distinct KV planes (up to the 96 of a real step) that the data is
several times the L2, and check the output of one plane against the torch reference.
"""
from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from hal.attention import PagedBatch
from hal.kernels.configs import KernelConfig, configs_for
from hal.kernels.launch import target_of

SHAPE = dict(num_heads=16, num_kv_heads=16, head_dim=128, hidden=2048, intermediate=5632, page=16)
L2_BYTES = 60 * 2 ** 20
DECODE_CELLS = [(1, 1024), (1, 2048), (64, 1024), (64, 2048), (128, 1024), (128, 2048)]  # (batch, ctx)
PREFILL_CELLS = [(8192, 0), (2048, 6144)]                                  # (new tokens, context)
SMALL_OP_TOKENS = (1, 64, 8192)
SWEEP_CELLS = [(1, 2048, 1), (64, 1024, 1), (1, 0, 8192)]                   # (batch, context, new)
DECODE_SWEEP = [KernelConfig(16, n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
PREFILL_SWEEP = [KernelConfig(64, 64, 4, 3), KernelConfig(128, 32, 4, 3), KernelConfig(128, 64, 8, 2),
                 KernelConfig(128, 64, 8, 3), KernelConfig(128, 128, 8, 2), KernelConfig(64, 128, 4, 2)]


def _time_us(fn: Callable[[], object], graph: bool) -> float:
    import triton.testing

    fn()
    ms = triton.testing.do_bench_cudagraph(fn) if graph else triton.testing.do_bench(fn)
    return ms * 1e3


def measure_ceilings(device: torch.device) -> tuple[float, float]:
    """(copy bytes/s counting read + write, bf16 matmul FLOP/s) on `device`."""
    src = torch.empty(2 ** 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_us = _time_us(lambda: dst.copy_(src), graph=False)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm_us = _time_us(lambda: a @ b, graph=False)
    return 2 * src.numel() / (copy_us * 1e-6), 2 * 8192 ** 3 / (mm_us * 1e-6)


class _Line:
    def __init__(self, bandwidth: float, flop_rate: float, print_fn: Callable[[str], None]) -> None:
        self.bandwidth, self.flop_rate, self.print = bandwidth, flop_rate, print_fn
        self.rows: list[dict] = []
        print_fn(f"{'kernel':18} {'cell':26} {'eager us':>9} {'graph us':>9} {'GB/s':>7} {'TFLOP/s':>8} "
                 f"{'floor us':>9} {'floor/graph':>11}  note")

    def add(self, kernel: str, cell: str, fn: Callable[[], object], num_bytes: float, flops: float = 0.0,
            calls: int = 1, note: str = "") -> dict:
        eager, graphed = _time_us(fn, False) / calls, _time_us(fn, True) / calls
        floor = max(num_bytes / self.bandwidth, flops / self.flop_rate) * 1e6
        row = dict(kernel=kernel, cell=cell, eager_us=eager, graph_us=graphed, gbps=num_bytes / graphed / 1e3,
                   tflops=flops / graphed / 1e6, floor_us=floor, note=note)
        self.print(f"{kernel:18} {cell:26} {eager:9.1f} {graphed:9.1f} {row['gbps']:7.0f} "
                   f"{row['tflops']:8.1f} {floor:9.1f} {floor / graphed:10.0%}  {note}")
        self.rows.append(row)
        return row


def _paged_setup(device, num_seqs: int, context: int, query_len: int, num_planes: int, dtype):
    from hal.kernels.backend import TritonPagedAttention

    s = SHAPE
    seq_len = context + query_len
    blocks_per_seq = -(-seq_len // s["page"])
    num_blocks = num_seqs * blocks_per_seq * num_planes
    pool = list(range(num_blocks))
    random.Random(0).shuffle(pool)
    tables = [[[pool.pop() for _ in range(blocks_per_seq)] for _ in range(num_seqs)]
              for _ in range(num_planes)]
    batch = PagedBatch([query_len] * num_seqs, [seq_len] * num_seqs, tables, s["page"])
    backend = TritonPagedAttention(s["num_heads"], s["num_kv_heads"], s["head_dim"], dtype, device, s["page"])
    cache = torch.randn(backend.kv_cache_shape(num_blocks), dtype=dtype, device=device)
    q = torch.randn(num_seqs * query_len, s["num_heads"], s["head_dim"], dtype=dtype, device=device)
    return backend, batch, cache, q


def _check(backend, batch, cache, q, out) -> float:
    from hal.common.torch_attention import TorchPagedAttention

    s = SHAPE
    reference = TorchPagedAttention(s["num_heads"], s["num_kv_heads"], s["head_dim"], torch.float32, q.device,
                                    s["page"])
    ref = reference.forward(q.float(), cache.float(), reference.build_meta(batch), 0, s["head_dim"] ** -0.5)
    return (out.float() - ref).abs().max().item()


def _attention_cell(line: _Line, device, dtype, num_seqs: int, context: int, query_len: int,
                    config: KernelConfig | None = None, label: str = "") -> dict:
    s = SHAPE
    token_bytes = 2 * s["num_kv_heads"] * s["head_dim"] * dtype.itemsize            # K + V of one token
    plane_bytes = num_seqs * (context + query_len) * token_bytes
    num_planes = max(1, min(96, math.ceil(4 * L2_BYTES / plane_bytes)))
    backend, batch, cache, q = _paged_setup(device, num_seqs, context, query_len, num_planes, dtype)
    if config is not None:
        key = "attention_decode" if query_len == 1 else "attention_prefill"
        backend.configs = {**backend.configs, key: config}
    meta = backend.build_meta(batch)
    scale = s["head_dim"] ** -0.5

    def step():
        for plane in range(num_planes):
            backend.forward(q, cache, meta, plane, scale)

    checked = "unchecked" if config else \
        f"max err {_check(backend, batch, cache, q, backend.forward(q, cache, meta, 0, scale)):.1e}"
    keys_seen = num_seqs * sum(context + i + 1 for i in range(query_len))          # causal
    flops = 4 * s["num_heads"] * s["head_dim"] * keys_seen * num_planes
    io = 2 * q.numel() * dtype.itemsize * num_planes                                # q in, out
    name = "attention_decode" if query_len == 1 else "attention_prefill"
    return line.add(name, label or f"B={num_seqs} ctx={context} q={query_len}", step,
                    plane_bytes * num_planes + io, flops, calls=num_planes,
                    note=f"{num_planes} planes, {checked}" + (f" {config}" if config else ""))


def _sdpa_cell(line: _Line, device, dtype, query_len: int, context: int) -> None:
    s = SHAPE
    q = torch.randn(1, s["num_heads"], query_len, s["head_dim"], dtype=dtype, device=device)
    k = torch.randn(1, s["num_kv_heads"], query_len + context, s["head_dim"], dtype=dtype, device=device)
    v = torch.randn_like(k)
    mask = None if context == 0 else torch.ones(query_len, query_len + context, dtype=torch.bool,
                                                device=device).tril(context)
    def fn():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)

    keys_seen = sum(context + i + 1 for i in range(query_len))
    line.add("torch sdpa (dense)", f"q={query_len} ctx={context}", fn, (q.numel() * 2 + k.numel() * 2) * 2,
             4 * s["num_heads"] * s["head_dim"] * keys_seen, note="reference: contiguous K/V, no paging")


def _small_op_cells(line: _Line, device, dtype, configs: dict[str, KernelConfig]) -> None:
    from hal.kernels.kv_write import write_kv
    from hal.kernels.ops import norm_add_norm, rms_norm, rotary, silu_and_mul

    s, size = SHAPE, dtype.itemsize

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device)

    for tokens in SMALL_OP_TOKENS:
        # distinct inputs per call, enough of them that one measurement does not sit in the L2
        reps = max(1, min(96, math.ceil(4 * L2_BYTES / (tokens * s["intermediate"] * 3 * size))))
        x = [randn(tokens, s["hidden"]) for _ in range(reps)]
        res = [randn(tokens, s["hidden"]) for _ in range(reps)]
        w = randn(s["hidden"])
        line.add("rms_norm+residual", f"T={tokens} x {s['hidden']}",
                 lambda x=x, res=res, w=w: [rms_norm(a, w, 1e-6, r, configs) for a, r in zip(x, res)],
                 3 * tokens * s["hidden"] * size * reps, calls=reps)
        # a sublayer boundary in one launch: Ouro's sandwich (where the line above runs twice, plus a
        # plain norm), Huginn's (sum_first: an add and two norms), pre-norm layers' (an add and a norm)
        for name, post, sum_first in (("norm_add_norm", w, False), ("norm_add_norm (sum_first)", w, True),
                                      ("norm_add_norm (pre-norm)", None, False)):
            line.add(name, f"T={tokens} x {s['hidden']}",
                     lambda x=x, res=res, w=w, post=post, sum_first=sum_first: [
                         norm_add_norm(a, r, post, w, 1e-6, sum_first, configs) for a, r in zip(x, res)],
                     4 * tokens * s["hidden"] * size * reps, calls=reps)
        q = [randn(tokens, s["num_heads"], s["head_dim"]) for _ in range(reps)]
        k = [randn(tokens, s["num_kv_heads"], s["head_dim"]) for _ in range(reps)]
        pos = torch.randint(0, 4096, (tokens,), device=device)
        line.add("rotary (neox)", f"T={tokens}",
                 lambda q=q, k=k, pos=pos: [rotary(a, b, pos, 1e6, False, configs) for a, b in zip(q, k)],
                 2 * (q[0].numel() + k[0].numel()) * size * reps, calls=reps)
        gate_up = [randn(tokens, 2 * s["intermediate"]) for _ in range(reps)]
        line.add("silu_and_mul", f"T={tokens} x {s['intermediate']}",
                 lambda gate_up=gate_up: [silu_and_mul(a, configs) for a in gate_up],
                 3 * tokens * s["intermediate"] * size * reps, calls=reps)
        cache = torch.empty(2, tokens // s["page"] + 1, s["page"], s["num_kv_heads"], s["head_dim"],
                            dtype=dtype, device=device)
        slots = torch.randperm(tokens, device=device)
        line.add("kv_write", f"T={tokens}",
                 lambda k=k, cache=cache, slots=slots: [write_kv(a, a, cache, slots, configs["kv_write"])
                                                        for a in k],
                 4 * k[0].numel() * size * reps, calls=reps)


def bench_kernels(device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16,
                  sweep: bool = False, print_fn: Callable[[str], None] = print) -> list[dict]:
    """Time every kernel at the Ouro-1.4B shapes on `device`; returns the rows it printed."""
    device = torch.device(device)
    target = target_of(device)
    configs = configs_for(target.arch)
    bandwidth, flop_rate = measure_ceilings(device)
    print_fn(f"# {target.backend} {target.arch}: copy {bandwidth / 1e12:.2f} TB/s (read + write), bf16 "
             f"matmul {flop_rate / 1e12:.0f} TFLOP/s (8192^3); configs_for({target.arch!r})")
    line = _Line(bandwidth, flop_rate, print_fn)
    for num_seqs, context in DECODE_CELLS:
        _attention_cell(line, device, dtype, num_seqs, context, 1)
    for query_len, context in PREFILL_CELLS:
        _attention_cell(line, device, dtype, 1, context, query_len)
        _sdpa_cell(line, device, dtype, query_len, context)
    _small_op_cells(line, device, dtype, configs)
    if sweep:
        print_fn("# sweep: attention_decode / attention_prefill configs (best first per cell)")
        for num_seqs, context, query_len in SWEEP_CELLS:
            candidates = DECODE_SWEEP if query_len == 1 else PREFILL_SWEEP
            rows = [_attention_cell(line, device, dtype, num_seqs, context, query_len, c,
                                    label=f"sweep B={num_seqs}") for c in candidates]
            best = min(rows, key=lambda r: r["graph_us"])
            print_fn(f"# best for B={num_seqs} ctx={context} q={query_len}: {best['graph_us']:.1f} us  "
                     f"{best['note']}")
    return line.rows


if __name__ == "__main__":
    import sys

    bench_kernels(sweep="--sweep" in sys.argv[1:])
