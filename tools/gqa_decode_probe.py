"""Probe (lever 85; run `PYTHONPATH=. python tools/gqa_decode_probe.py [budget s]` on a GPU): the unified FP8 decode kernel at Nanbeige4.2-3B's shape (48 query heads, 8 KV
heads, D 128) reading V with keys contiguous (V^T strides over the same bytes: wrong values, the
access pattern a transposed V layout would give) against the head-major V of today, and bf16."""
import math, random, sys, time
sys.path.insert(0, "tools")
import torch
from decode_kernels_bench import Bench, HEADER, L2_BYTES
from hal.attention import PagedBatch
from hal.common.kv_quant import encode_scales, power_of_two_at_least
from hal.kernels.backend import TritonPagedAttention, device_compute_units
from hal.kernels.configs import KernelConfig
from hal.kernels.attention import attention_launches
from hal.kernels.launch import run_launch
from hal.kernels.splits import num_kv_splits

H, KVH, D, PAGE = 48, 8, 128, 16
dev = torch.device("cuda")
bench = Bench(dev, time.monotonic() + float(sys.argv[1]) if len(sys.argv) > 1 else 150,
              device_units=device_compute_units(dev))
print(HEADER)
CONFIGS = [KernelConfig(16, 32, 4, 3), KernelConfig(16, 16, 4, 3), KernelConfig(16, 16, 2, 4), KernelConfig(16, 32, 4, 2),
           KernelConfig(16, 64, 8, 2), KernelConfig(16, 64, 4, 2), KernelConfig(16, 32, 8, 3), KernelConfig(16, 128, 8, 2)]
for num_seqs in (64, 128):
    seq_len = 1025
    for kv in (None, torch.float8_e4m3fn):
        vb = 2 if kv is None else 1
        plane_bytes = num_seqs * seq_len * 2 * KVH * (D * vb + (0 if kv is None else 1))
        planes = max(2, min(64, math.ceil(4 * L2_BYTES / plane_bytes)))
        bps = -(-seq_len // PAGE)
        nb = num_seqs * bps * planes
        pool = list(range(nb)); random.Random(0).shuffle(pool)
        # mostly consecutive pages as the engine's: each sequence's blocks in one run
        tables = [[list(range((p * num_seqs + s) * bps, (p * num_seqs + s + 1) * bps)) for s in range(num_seqs)]
                  for p in range(planes)]
        batch = PagedBatch([1] * num_seqs, [seq_len] * num_seqs, tables, PAGE)
        be = TritonPagedAttention(H, KVH, D, torch.bfloat16, dev, PAGE, kv_dtype=kv)
        cache = torch.empty(be.kv_cache_shape(nb), dtype=be.kv_cache_dtype, device=dev)
        if kv is None:
            cache.normal_()
        else:
            lay = be.kv_layout
            lay.values(cache).copy_(torch.randn(lay.values(cache).shape, device=dev).to(kv))
            lay.scales(cache).copy_(encode_scales(power_of_two_at_least(
                torch.rand(lay.scales(cache).shape, device=dev) * 0.1 + 0.01), kv))
        meta = be.build_meta(batch)
        values, scales = be._views(cache)
        q = torch.randn(num_seqs, H, D, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(q)
        splits = num_kv_splits(num_seqs, KVH, bench.device_units)
        name = "bf16" if kv is None else "fp8"
        for cfg in CONFIGS if kv is not None else [be.configs["attention_decode"]]:
            for vt in ((False, True) if kv is not None else (False,)):
                for ns in (splits, 2 * splits) if cfg == CONFIGS[0] else (splits,):
                    def launches(p, cfg=cfg, vt=vt, ns=ns):
                        ls = attention_launches(q, values, meta.block_tables[p], meta.seq_lens, meta.query_start_loc,
                                                D ** -0.5, cfg, ns, be.configs["attention_reduce"], out, "cuda", scales)
                        if vt:
                            a = list(ls[0].args); a[23], a[25] = 1, PAGE
                            ls[0] = ls[0]._replace(args=tuple(a), kwargs={**ls[0].kwargs, "V_KEYS_CONTIGUOUS": True})
                        return ls
                    built = [launches(p) for p in range(planes)]
                    bench.cell("gqa", f"B{num_seqs}xK1024", num_seqs,
                               f"{name} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} x{ns}{' VT' if vt else ''}",
                               lambda built=built: [lambda ls=ls: [run_launch(l) for l in ls] for ls in built], plane_bytes)
        del cache, be, meta
        torch.cuda.empty_cache()
