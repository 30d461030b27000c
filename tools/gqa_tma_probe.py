"""Probe (lever 86): grouped-query FP8 decode with K and V tiles loaded by TMA, V stored transposed.

The unified kernel's FP8 decode at Nanbeige4.2-3B's shape (48 query heads over 8 KV heads, D 128)
runs at 39% of its floor, latency-bound at about 122 registers (docs/performance.md, levers 84-85):
a third of its instructions compute tile addresses, and its V tile reaches the tensor cores through
byte-wise shared-memory reads because an 8-bit tile has no transposing load. This kernel asks what a
layout with each page's V transposed (`[NB, KVH, D, PAGE]`, keys contiguous) and tiles fetched by
TMA descriptors (one per page: no pointer tensors) would give, before the cache layout changes.

A program owns one (sequence, KV head) and its group's query rows (`BLOCK_M` = 16 tensor-core rows, `GROUP`
used) and walks the sequence's pages, `PAGES` per iteration; the page numbers come one iteration
ahead so the descriptor loads depend on no load of their own iteration. Scales are exponent bytes
(hal/common/kv_quant.py): key n's scale multiplies score column n; V's multiplies P's column n over
the tile's largest, and the product is multiplied by that largest (the unified kernel's algebra).

`python tools/gqa_tma_probe.py check` compares it with a float32 reference (CPU: set
TRITON_INTERPRET=1; GPU: as is); `python tools/gqa_tma_probe.py [budget s]` on a GPU times it beside
today's unified kernel at 64 and 128 x 1K.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

H, KVH, D, PAGE = 48, 8, 128, 16
LOG2E = 1.4426950408889634
FP16_MAX = tl.constexpr(65504.0)
LAZY_MARGIN = tl.constexpr(8.0)   # log2 units: P <= 2^8
V_BIAS = tl.constexpr(6)          # P's V factor is 2^(v_exp - v_ref + 6) <= 2^6: P * factor <= 2^14 fits fp16


@triton.jit
def _page(q, k_desc, vt_desc, k_scale_ptr, v_scale_ptr, slot, keys, seq_len, qk_scale,
          D: tl.constexpr, PAGE: tl.constexpr, V_T: tl.constexpr):
    """One page's scores `[M, PAGE]` (log2 units, masked), its V^T tile widened to fp16 and its V exponents."""
    k = k_desc.load([slot * PAGE, 0]).to(tl.float16)                 # [PAGE, D]
    if V_T:
        v = tl.trans(vt_desc.load([slot * D, 0]).to(tl.float16))     # [D, PAGE] in the cache: keys contiguous
    else:
        v = vt_desc.load([slot * PAGE, 0]).to(tl.float16)             # [PAGE, D] in the cache
    k_exp = tl.load(k_scale_ptr + slot * PAGE + tl.arange(0, PAGE)).to(tl.int32)
    v_exp = tl.load(v_scale_ptr + slot * PAGE + tl.arange(0, PAGE)).to(tl.int32)
    k_scale = (k_exp << 23).to(tl.float32, bitcast=True)
    v_exp = tl.where(keys < seq_len, v_exp, 0)
    s = tl.dot(q, tl.trans(k)) * (k_scale * qk_scale)[None, :]
    return tl.where((keys < seq_len)[None, :], s, float("-inf")), v, v_exp


@triton.jit
def _ratio(v_exp, v_ref):
    """2^(v_exp - v_ref) as float32 (0 below float32's normal range), exactly."""
    return (tl.maximum(v_exp - v_ref + 127, 0) << 23).to(tl.float32, bitcast=True)


@triton.jit
def gqa_tma_decode_kernel(q_ptr, k_desc, vt_desc, k_scale_ptr, v_scale_ptr, table_ptr, seq_lens_ptr, out_ptr,
                          part_out_ptr, part_max_ptr, part_sum_ptr,
                          stride_qs, stride_qh, stride_table, qk_scale,
                          KVH: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                          BLOCK_M: tl.constexpr, PAGES: tl.constexpr, HEADS_FIRST: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, V_T: tl.constexpr):
    if HEADS_FIRST:
        kvh = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    heads = kvh * GROUP + rows
    q_off = seq * stride_qs + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=(rows < GROUP)[:, None], other=0.0).to(tl.float32)
    q = tl.clamp(q, -FP16_MAX, FP16_MAX).to(tl.float16)
    # Lazy references: the score maximum m_i moves only when a score passes it by 2^LAZY_MARGIN, the
    # V exponent v_ref only up; P is scaled by 2^(v_exp - v_ref + V_BIAS), so acc is in units of 2^(v_ref - 127 - V_BIAS)
    # and rescales only on the tiles where a reference moves.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    v_ref = tl.zeros([], tl.int32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    num_pages = tl.cdiv(seq_len, PAGE)
    tiles_per_split = tl.cdiv(tl.cdiv(num_pages, PAGES), NUM_SPLITS)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, tl.cdiv(num_pages, PAGES))
    table = table_ptr + seq * stride_table
    first = tile_lo * PAGES
    page0 = tl.load(table + first, mask=first < num_pages, other=0)
    page1 = tl.load(table + first + 1, mask=first + 1 < num_pages, other=0)
    for t in range(tile_lo, tile_hi):
        nxt = (t + 1) * PAGES
        next0 = tl.load(table + nxt, mask=nxt < num_pages, other=0)
        next1 = tl.load(table + nxt + 1, mask=nxt + 1 < num_pages, other=0)
        keys = t * PAGES * PAGE + tl.arange(0, PAGE)
        s0, vt0, e0 = _page(q, k_desc, vt_desc, k_scale_ptr, v_scale_ptr, page0 * KVH + kvh, keys, seq_len,
                            qk_scale, D, PAGE, V_T)
        tile_max = tl.max(s0, 1)
        tile_v = tl.max(e0, 0)
        if PAGES == 2:
            s1, vt1, e1 = _page(q, k_desc, vt_desc, k_scale_ptr, v_scale_ptr, page1 * KVH + kvh, keys + PAGE,
                                seq_len, qk_scale, D, PAGE, V_T)
            tile_max = tl.maximum(tile_max, tl.max(s1, 1))
            tile_v = tl.maximum(tile_v, tl.max(e1, 0))
        m_new = tl.where(tile_max > m_i + LAZY_MARGIN, tile_max, m_i)
        v_new = tl.maximum(v_ref, tile_v)
        if (tl.max(m_new - m_i, 0) > 0.0) | (v_new > v_ref):
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * (alpha * _ratio(v_ref, v_new))[:, None]
            m_i = m_new
            v_ref = v_new
        p0 = tl.exp2(s0 - m_i[:, None])
        l_i += tl.sum(p0, 1)
        acc = tl.dot((p0 * _ratio(e0 + V_BIAS, v_ref)[None, :]).to(tl.float16), vt0, acc)
        if PAGES == 2:
            p1 = tl.exp2(s1 - m_i[:, None])
            l_i += tl.sum(p1, 1)
            acc = tl.dot((p1 * _ratio(e1 + V_BIAS, v_ref)[None, :]).to(tl.float16), vt1, acc)
        page0 = next0
        page1 = next1
    acc = acc * _ratio(v_ref, 127 + V_BIAS)
    mask = (rows < GROUP)[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + q_off, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        num_seqs = tl.num_programs(1 if HEADS_FIRST else 0)
        part_row = (split * num_seqs + seq) * (KVH * GROUP) + heads                       # [M]
        tl.store(part_out_ptr + part_row[:, None] * D + d[None, :], acc, mask=mask)
        tl.store(part_max_ptr + part_row, m_i, mask=rows < GROUP)
        tl.store(part_sum_ptr + part_row, l_i, mask=rows < GROUP)


class TmaCache:
    """An FP8 cache in the probe's layout: K `[NB, KVH, PAGE, D]`, V `[NB, KVH, D, PAGE]` (`v_transposed`) or
    `[NB, KVH, PAGE, D]` (today's head-major layout), exponent-byte scales `[NB, KVH, PAGE]` each."""

    def __init__(self, num_blocks: int, device: torch.device, v_transposed: bool = True,
                 dtype=torch.float8_e4m3fn):
        self.v_transposed = v_transposed
        self.k = torch.randn(num_blocks, KVH, PAGE, D, device=device).to(dtype)
        v_shape = (num_blocks, KVH, D, PAGE) if v_transposed else (num_blocks, KVH, PAGE, D)
        self.vt = torch.randn(v_shape, device=device).to(dtype)
        self.k_scale = torch.randint(112, 128, (num_blocks, KVH, PAGE), dtype=torch.uint8, device=device)
        self.v_scale = torch.randint(112, 128, (num_blocks, KVH, PAGE), dtype=torch.uint8, device=device)
        self.k_desc = TensorDescriptor.from_tensor(self.k.view(-1, D), [PAGE, D])
        self.vt_desc = TensorDescriptor.from_tensor(self.vt.view(-1, v_shape[-1]), list(v_shape[-2:]))

    def v_rows(self) -> torch.Tensor:
        """V as `[NB, KVH, PAGE, D]` float32 on the CPU."""
        v = self.vt.float().cpu()
        return v.transpose(-1, -2) if self.v_transposed else v


def decode(q: torch.Tensor, cache: TmaCache, table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
           warps: int = 4, stages: int = 3, pages: int = 1, heads_first: bool = False, splits: int = 1):
    """Launch the probe kernel (and, with `splits > 1`, the engine's split reduce)."""
    from hal.kernels.configs import KernelConfig
    from hal.kernels.launch import run_launch
    from hal.kernels.splits import reduce_launch, split_parts

    num_seqs = q.shape[0]
    parts = split_parts(q, splits, D)
    grid = (KVH, num_seqs, splits) if heads_first else (num_seqs, KVH, splits)
    gqa_tma_decode_kernel[grid](q, cache.k_desc, cache.vt_desc, cache.k_scale, cache.v_scale, table, seq_lens, out,
                                *parts, q.stride(0), q.stride(1), table.stride(0), D ** -0.5 * LOG2E,
                                KVH=KVH, GROUP=H // KVH, D=D, PAGE=PAGE, BLOCK_M=16, PAGES=pages,
                                HEADS_FIRST=heads_first, NUM_SPLITS=splits, V_T=cache.v_transposed, num_warps=warps, num_stages=stages)
    if splits > 1:
        run_launch(reduce_launch(out, parts, KernelConfig(1, 1, 4, 1), "cuda"))
    return out


def reference(q, cache, table, seq_lens):
    """float32 attention over the dequantized cache."""
    out = torch.empty(q.shape, dtype=torch.float32)
    ks = torch.exp2(cache.k_scale.float().cpu() - 127)
    vs = torch.exp2(cache.v_scale.float().cpu() - 127)
    k_all, v_all = cache.k.float().cpu(), cache.v_rows()
    for s in range(q.shape[0]):
        n = int(seq_lens[s])
        pages = table[s, :math.ceil(n / PAGE)].cpu()
        k = (k_all[pages] * ks[pages][..., None]).permute(1, 0, 2, 3).reshape(KVH, -1, D)[:, :n]
        v = (v_all[pages] * vs[pages][..., None]).permute(1, 0, 2, 3).reshape(KVH, -1, D)[:, :n]
        qs = q[s].float().cpu().view(KVH, H // KVH, D)
        w = torch.softmax(qs @ k.transpose(-1, -2) * D ** -0.5, -1)
        out[s] = (w @ v).reshape(H, D)
    return out


def check(device: torch.device):
    torch.manual_seed(0)
    seq_lens = torch.tensor([1, 17, 40, 100], dtype=torch.int32, device=device)
    max_pages = 8
    table = torch.randperm(4 * max_pages, device=device).view(4, max_pages).to(torch.int32)
    q = torch.randn(4, H, D, dtype=torch.bfloat16, device=device)
    for v_transposed, pages, heads_first, splits in ((True, 1, False, 1), (True, 2, False, 1), (True, 1, True, 1),
                                                     (True, 2, True, 4), (False, 1, False, 3), (False, 2, False, 2)):
        cache = TmaCache(4 * max_pages, device, v_transposed)
        ref = reference(q, cache, table, seq_lens)
        out = decode(q, cache, table, seq_lens, torch.empty_like(q), pages=pages, heads_first=heads_first,
                     splits=splits)
        err = ((out.float().cpu() - ref).abs().max() / ref.abs().max()).item()
        print(f"v_transposed={v_transposed} pages={pages} heads_first={heads_first} splits={splits}: max error {err:.2e} (relative to max |out|)")
        assert err < 2e-2, err


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "check":
        check(torch.device("cpu" if os.environ.get("TRITON_INTERPRET") else "cuda"))


def _time(budget_s: float):
    import random
    import time
    sys.path.insert(0, os.path.dirname(__file__))
    from decode_kernels_bench import Bench, HEADER, L2_BYTES
    from hal.attention import PagedBatch
    from hal.common.kv_quant import encode_scales, power_of_two_at_least
    from hal.kernels.attention import attention_launches
    from hal.kernels.backend import TritonPagedAttention, device_compute_units
    from hal.kernels.configs import KernelConfig
    from hal.kernels.launch import run_launch
    from hal.kernels.splits import num_kv_splits

    dev = torch.device("cuda")
    bench = Bench(dev, time.monotonic() + budget_s, device_units=device_compute_units(dev))
    print(HEADER)
    probe_configs = [(1, 3, 2, 2), (1, 3, 2, 1), (2, 3, 2, 1), (1, 4, 2, 2)]
    for num_seqs in (64, 128):
        seq_len = 1025
        bps = -(-seq_len // PAGE)
        fp8_bytes = num_seqs * seq_len * 2 * KVH * (D + 1)
        planes = max(2, min(64, math.ceil(4 * L2_BYTES / fp8_bytes)))
        nb = num_seqs * bps * planes
        tables = [torch.arange((p * num_seqs) * bps, (p + 1) * num_seqs * bps, dtype=torch.int32,
                               device=dev).view(num_seqs, bps) for p in range(planes)]
        seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=dev)
        q = torch.randn(num_seqs, H, D, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(q)
        shape = f"B{num_seqs}xK1024"
        for v_transposed in (True, False):
            cache = TmaCache(nb, dev, v_transposed)
            ref = reference(q, cache, tables[0], seq_lens).to(dev)
            for warps, stages, pages, splits in probe_configs:
                heads_first = False
                kw = dict(warps=warps, stages=stages, pages=pages, heads_first=heads_first, splits=splits)

                def err(kw=kw):
                    o = decode(q, cache, tables[0], seq_lens, torch.empty_like(q), **kw)
                    return ((o.float() - ref).norm() / ref.norm()).item()
                bench.cell("gqa", shape, num_seqs, f"tma{' VT' if v_transposed else ' V'} w{warps} s{stages} p{pages} x{splits}",
                           lambda kw=kw: [lambda t=t: decode(q, cache, t, seq_lens, out, **kw) for t in tables],
                           fp8_bytes, err)
            del cache
        # today's unified kernel at the same shape, FP8 (head-major values) and bf16
        for kv in (torch.float8_e4m3fn, None):
            be = TritonPagedAttention(H, KVH, D, torch.bfloat16, dev, PAGE, kv_dtype=kv)
            kv_cache = torch.empty(be.kv_cache_shape(nb), dtype=be.kv_cache_dtype, device=dev)
            if kv is None:
                kv_cache.normal_()
            else:
                lay = be.kv_layout
                lay.values(kv_cache).copy_(torch.randn(lay.values(kv_cache).shape, device=dev).to(kv))
                lay.scales(kv_cache).copy_(encode_scales(power_of_two_at_least(
                    torch.rand(lay.scales(kv_cache).shape, device=dev) * 0.1 + 0.01), kv))
            lists = [[tables[p][s].tolist() for s in range(num_seqs)] for p in range(planes)]
            meta = be.build_meta(PagedBatch([1] * num_seqs, [seq_len] * num_seqs, lists, PAGE))
            values, scales = be._views(kv_cache)
            splits = num_kv_splits(num_seqs, KVH, bench.device_units)
            key = "attention_decode" if kv is None else "attention_decode_fp8"
            base = be.configs[key]
            for cfg in (base, dataclasses.replace(base, heads_first=1 - base.heads_first)):
                def launches(p, cfg=cfg):
                    return attention_launches(q, values, meta.block_tables[p], meta.seq_lens, meta.query_start_loc,
                                              D ** -0.5, cfg, splits, be.configs["attention_reduce"], out, "cuda",
                                              scales)
                built = [launches(p) for p in range(planes)]
                name = "bf16" if kv is None else "fp8"
                bench.cell("gqa", shape, num_seqs, f"main {name} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
                           f"hf{cfg.heads_first}",
                           lambda built=built: [lambda ls=ls: [run_launch(x) for x in ls] for ls in built],
                           fp8_bytes * (1 if kv is not None else 2 * D / (D + 1)))
            del kv_cache, be, meta
        torch.cuda.empty_cache()
    return bench


if __name__ == "__main__" and not (len(sys.argv) > 1 and sys.argv[1] == "check"):
    _time(float(sys.argv[1]) if len(sys.argv) > 1 else 150)
