"""Cross-compile every hal/kernels kernel in every config a Hal can choose, on the CPU, and check
the machine code: `python -m xcompile` prints the table (exit 1 on a problem).

Each kernel is built through the same `*_launch` function the Hals call, from small CPU tensors
with the Ouro-1.4B shape (16 heads, 16 KV heads, head dim 128, bf16, page 16), and compiled with
`triton.compile` for a `GPUTarget` with the runtime's own argument specialisation (16-byte
alignment, integers equal to 1). Checks per compiled kernel:
  * AMD (gfx942, gfx950): MFMA instructions where the kernel has a `tl.dot`, no VGPR spills, no
    scratch (`.private_segment_fixed_size`), LDS (`metadata.shared`) within the CU's LDS;
  * NVIDIA (sm_90, sm_80): `wgmma` in the PTX of the large-tile (prefill) configs on sm_90, an MMA
    otherwise, no spills (`cuobjdump -res-usage`: STACK/LOCAL 0; a 32-byte stack that is only
    libdevice's sin/cos reduction array for arguments past 105615 rad is allowed, `TRIG_DEPOT_BYTES`),
    shared memory within the SM's.
A table is compiled for the targets that can pick it: each arch's own, "default" for all three.
The decode projections (hal/kernels/gemv.py) compile at Ouro-1.4B shapes, one prologue each
(`GEMV_CASES`), and must load the weight in 16-byte vectors.
The FP8 variants (`FP8_CASES`: attention over an FP8 KV cache, the quantizing KV write, the W8A16
linear) compile for the arch tables of the targets that have FP8, each in its own format: e4m3fn on
sm_90 and gfx950, e4m3fnuz on gfx942 (`--fp8`).
Levels: "compiles for" and "checked in the machine code"; nothing here ran on an AMD GPU.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from hal.kernels.configs import KernelConfig, all_configs
from hal.kernels.launch import Launch

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")     # silences triton 3.9's deprecation warning


class Target(NamedTuple):
    backend: str         # "hip" | "cuda"
    arch: str | int      # GPUTarget's arch
    warp_size: int
    shared_limit: int    # bytes of LDS / shared memory one program may use


TARGETS = {
    "gfx942": Target("hip", "gfx942", 64, 64 * 1024),
    "gfx950": Target("hip", "gfx950", 64, 160 * 1024),
    "sm_90": Target("cuda", 90, 32, 227 * 1024),
    "sm_80": Target("cuda", 80, 32, 163 * 1024),
}
TABLE_TARGETS = {"gfx942": ("gfx942",), "gfx950": ("gfx950",), "sm_90": ("sm_90",), "sm_80": ("sm_80",),
                 "default": ("gfx942", "gfx950", "sm_90")}
SHAPE = dict(num_heads=16, num_kv_heads=16, head_dim=128, page_size=16, dtype=torch.bfloat16)


class Case(NamedTuple):
    name: str            # "<config key>" or "<config key>/<variant>"
    config_key: str
    has_dot: bool
    wants_wgmma: bool    # large tiles: sm_90 must use wgmma
    build: Callable[[KernelConfig, str], Launch]   # (config, "hip" | "cuda") -> launch on CPU tensors


def _fp8_cache(kv_dtype: torch.dtype, num_kv_heads: int = SHAPE["num_kv_heads"]) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, scales) views of an FP8 cache of 8 blocks in `hal.common.kv_quant.QuantLayout`."""
    from hal.common.kv_quant import QuantLayout

    s = SHAPE
    layout = QuantLayout(num_kv_heads, s["head_dim"], s["page_size"], kv_dtype)
    cache = torch.empty(layout.cache_shape(8), dtype=torch.uint8)
    return layout.values(cache), layout.scales(cache)


def _attention(config: KernelConfig, target: str, num_seqs: int, query_len: int, num_splits: int,
               dtype: torch.dtype = SHAPE["dtype"], kv_dtype: torch.dtype | None = None,
               rows: bool = False, rotary: bool = False, group: int = 1, own_kv: bool = False) -> Launch:
    """The unified kernel's launch, or with `rows` the row-stream decode kernel's (with `rotary`: the
    variant that rotates and stores this step's K/V itself; `group` query heads per KV head; `own_kv`:
    prompts over this step's K/V, hal/kernels/attend.py)."""
    from hal.kernels.attention import attention_launches
    from hal.kernels.row_decode import NewKV, row_decode_launches

    s = SHAPE
    q = torch.empty(num_seqs * query_len, s["num_heads"], s["head_dim"], dtype=dtype)
    cache = torch.empty(2, 8, s["page_size"], s["num_kv_heads"] // group, s["head_dim"], dtype=dtype)
    scales = None
    if kv_dtype is not None:
        cache, scales = _fp8_cache(kv_dtype, s["num_kv_heads"] // group)
    table = torch.zeros(num_seqs, 8, dtype=torch.int32)
    seq_lens = torch.zeros(num_seqs, dtype=torch.int32)
    starts = torch.zeros(num_seqs + 1, dtype=torch.int32)
    args = (q, cache, table, seq_lens, starts, 0.1, config, num_splits, config, torch.empty_like(q), target, scales)
    if own_kv:
        kv = torch.empty(q.shape[0], 2, s["num_kv_heads"] // group, s["head_dim"], dtype=dtype)
        return attention_launches(*args[:-1], own_kv=(kv[:, 0], kv[:, 1]))[0]
    if not rows:
        return attention_launches(*args)[0]
    tokens = q.shape[0]
    kv = q[:, ::group]
    new_kv = NewKV(torch.empty_like(kv), torch.empty_like(kv), torch.zeros(tokens, dtype=torch.int64),
                   torch.empty(s["head_dim"] // 2), torch.zeros(tokens, dtype=torch.int64), False) if rotary else None
    return row_decode_launches(*args, new_kv)[0]


def _gqa_decode(config: KernelConfig, target: str, kv_dtype: torch.dtype | None, num_seqs: int = 64) -> Launch:
    """hal/kernels/gqa_decode.py's launch at Nanbeige4.2-3B's grouping (6 query heads per KV head, head dim
    128): TMA descriptors over an FP8 cache's head-major values, or (`kv_dtype` None) a 16-bit cache."""
    from hal.common.kv_quant import QuantLayout
    from hal.kernels.gqa_decode import gqa_decode_launches

    if kv_dtype is None:
        values, scales = torch.empty(2, 8, 16, 2, 128, dtype=SHAPE["dtype"]), None
    else:
        layout = QuantLayout(2, 128, 16, kv_dtype)
        cache = torch.empty(layout.cache_shape(8), dtype=torch.uint8)
        values, scales = layout.values(cache), layout.scales(cache)
    q = torch.empty(num_seqs, 12, 128, dtype=SHAPE["dtype"])
    table = torch.zeros(num_seqs, 8, dtype=torch.int32)
    return gqa_decode_launches(q, values, scales, table, torch.zeros(num_seqs, dtype=torch.int32),
                               torch.zeros(num_seqs + 1, dtype=torch.int32), 0.1, config, config,
                               torch.empty_like(q), target, 132)[0]


def _reduce(config: KernelConfig, target: str) -> Launch:
    from hal.kernels.attention import attention_launches

    s = SHAPE
    q = torch.empty(1, s["num_heads"], s["head_dim"], dtype=s["dtype"])
    cache = torch.empty(2, 8, s["page_size"], s["num_kv_heads"], s["head_dim"], dtype=s["dtype"])
    table, lens = torch.zeros(1, 8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    return attention_launches(q, cache, table, lens, torch.zeros(2, dtype=torch.int32), 0.1,
                              KernelConfig(16, 32, 4, 1), 8, config,
                              torch.empty_like(q), target)[1]


def _kv_write(config: KernelConfig, target: str, kv_dtype: torch.dtype | None = None,
              dequantized: bool = False) -> Launch:
    """The KV write; with `dequantized`, the 8-bit write that also hands back what the cache holds
    (a prefill attending over its fresh K/V, hal/kernels/fresh.py)."""
    from hal.kernels.kv_write import kv_write_launch

    s = SHAPE
    k = torch.empty(4, s["num_kv_heads"], s["head_dim"], dtype=s["dtype"])
    cache = torch.empty(2, 8, s["page_size"], s["num_kv_heads"], s["head_dim"], dtype=s["dtype"])
    scales = None
    if kv_dtype is not None:
        cache, scales = _fp8_cache(kv_dtype)
    held = (torch.empty_like(k), torch.empty_like(k)) if dequantized else None
    return kv_write_launch(k, torch.empty_like(k), cache, torch.zeros(4, dtype=torch.int64), config, target,
                           scales, held)


def _fp8_linear(config: KernelConfig, target: str, fp8: torch.dtype, num_rows: int) -> Launch:
    """Ouro-1.4B's gate|up projection (2048 -> 2 x 5632) at `num_rows` tokens."""
    from hal.kernels.fp8_linear import fp8_linear_launch

    x = torch.empty(num_rows, 2048, dtype=SHAPE["dtype"])
    weight = torch.empty(2 * 5632, 2048, dtype=fp8)
    scale = torch.empty(2 * 5632, dtype=torch.float32)
    out = torch.empty(num_rows, 2 * 5632, dtype=x.dtype)
    return fp8_linear_launch(x, weight, scale, None, out, config, target)


def _fp8_linear_w8a8(config: KernelConfig, target: str, fp8: torch.dtype, num_rows: int) -> Launch:
    """Ouro-1.4B's down projection (5632 -> 2048) on `num_rows` rows quantized per row (W8A8), with PDL on
    CUDA as `run_launch` gives it on sm_90 (its first weight tile loads before the wait)."""
    from hal.kernels.fp8_linear import fp8_linear_launch, split_plan

    x = torch.empty(num_rows, 5632, dtype=fp8)
    weight = torch.empty(2048, 5632, dtype=fp8)
    scale = torch.empty(2048, dtype=torch.float32)
    out = torch.empty(num_rows, 2048, dtype=SHAPE["dtype"])
    launch = fp8_linear_launch(x, weight, scale, None, out, config, target,
                               torch.empty(num_rows, dtype=torch.float32),
                               split_plan(num_rows, 2048, 5632, config, num_compute_units=132),
                               workspace=torch.empty(16 * num_rows * 2048),
                               counters=torch.zeros(1024, dtype=torch.int32))
    return launch._replace(kwargs={**launch.kwargs, "PDL": target == "cuda"})


def _quantize_rows(config: KernelConfig, target: str, fp8: torch.dtype) -> Launch:
    """The W8A8 path's activation quantization of 64 rows of Ouro-1.4B's MLP input (5632)."""
    from hal.kernels.fp8_rows import quantize_rows_launch

    x = torch.empty(64, 5632, dtype=SHAPE["dtype"])
    return quantize_rows_launch(x, torch.empty(x.shape, dtype=fp8), torch.empty(64, 1), config, target)


def _silu_mul_quantize_rows(config: KernelConfig, target: str, fp8: torch.dtype) -> Launch:
    """The same quantization fused with SwiGLU: 64 rows of Ouro-1.4B's gate | up (2 x 5632)."""
    from hal.kernels.fp8_rows import silu_mul_quantize_rows_launch

    x = torch.empty(64, 2 * 5632, dtype=SHAPE["dtype"])
    return silu_mul_quantize_rows_launch(x, torch.empty(64, 5632, dtype=fp8), torch.empty(64, 1), config, target)


def _norm_add_norm_quantize(config: KernelConfig, target: str, fp8: torch.dtype) -> Launch:
    """The quantization fused with a sandwich boundary (Ouro): 64 rows of Ouro-1.4B's hidden (2048)."""
    from hal.kernels.fp8_rows import norm_add_norm_quantize_launch

    x = torch.empty(64, 2048, dtype=SHAPE["dtype"])
    weight = torch.empty(2048, dtype=x.dtype)
    return norm_add_norm_quantize_launch(x, torch.empty_like(x), weight, weight, 1e-6, torch.empty(x.shape, dtype=fp8),
                                         torch.empty(64, 1), torch.empty_like(x), x.dtype, config, target)


def _rms_norm(config: KernelConfig, target: str, residual: bool) -> Launch:
    from hal.kernels.norms import rms_norm_launch

    x = torch.empty(4, 2048, dtype=SHAPE["dtype"])
    res = torch.empty_like(x) if residual else None
    weight = torch.empty(2048, dtype=x.dtype)
    return rms_norm_launch(x, weight, 1e-6, res, torch.empty_like(x), config, target)


def _norm_add_norm(config: KernelConfig, target: str, boundary: str) -> Launch:
    """One of the three boundaries: "sandwich" (Ouro), "sum_first" (Huginn), "pre_norm" (Nanbeige)."""
    from hal.kernels.norms import norm_add_norm_launch

    x = torch.empty(4, 2048, dtype=SHAPE["dtype"])
    weight = torch.empty(2048, dtype=x.dtype)
    post_weight = None if boundary == "pre_norm" else weight
    return norm_add_norm_launch(x, torch.empty_like(x), post_weight, weight, 1e-6, torch.empty_like(x),
                                torch.empty_like(x), config, target, sum_first=boundary == "sum_first")


def _rotary(config: KernelConfig, target: str, interleaved: bool) -> Launch:
    from hal.kernels.ops import rotary_launch

    s = SHAPE
    q = torch.empty(4, s["num_heads"], s["head_dim"], dtype=s["dtype"])
    k = torch.empty(4, s["num_kv_heads"], s["head_dim"], dtype=s["dtype"])
    return rotary_launch(q, k, torch.zeros(4, dtype=torch.int64), torch.empty(s["head_dim"] // 2),
                         torch.empty_like(q), torch.empty_like(k), interleaved, config, target)


def _rotary_kv_write(config: KernelConfig, target: str, interleaved: bool, keep_kv: bool = False,
                     kv_dtype: torch.dtype | None = None) -> Launch:
    """Rotary + KV write at 4 tokens (heads over several programs); `keep_kv` (a fresh prefill's
    rotated k and contiguous v handed back) at 512 tokens, one program per token; `kv_dtype`: the
    quantizing write."""
    from hal.kernels.rotary_kv import rotary_kv_write_launch

    s = SHAPE
    tokens = 512 if keep_kv else 4
    qkv = torch.empty(tokens, s["num_heads"] + 2 * s["num_kv_heads"], s["head_dim"], dtype=s["dtype"])
    q, k, v = qkv[:, :16], qkv[:, 16:32], qkv[:, 32:]            # views of the fused projection
    cache = torch.empty(2, 8, s["page_size"], s["num_kv_heads"], s["head_dim"], dtype=s["dtype"])
    scales = None
    if kv_dtype is not None:
        cache, scales = _fp8_cache(kv_dtype)
    return rotary_kv_write_launch(q, k, v, torch.zeros(tokens, dtype=torch.int64), torch.empty(s["head_dim"] // 2),
                                  cache, torch.zeros(tokens, dtype=torch.int64), torch.empty_like(q), interleaved,
                                  config, target, torch.empty_like(k) if keep_kv else None, scales,
                                  v_out=torch.empty(v.shape, dtype=v.dtype) if keep_kv else None)


def _silu_and_mul(config: KernelConfig, target: str) -> Launch:
    from hal.kernels.ops import silu_and_mul_launch

    x = torch.empty(4, 2 * 5632, dtype=SHAPE["dtype"])
    return silu_and_mul_launch(x, torch.empty(4, 5632, dtype=x.dtype), config, target)


def _gemv(config: KernelConfig, target: str, num_rows: int, n: int, k: int, prologue: str,
          out_residual: bool = False, fp8: torch.dtype | None = None) -> Launch:
    """A decode projection of hal/kernels/gemv.py at an Ouro-1.4B shape, `num_rows` rows, split-K as
    the ops plan it for 132 compute units (an H200); with `fp8`, FP8 weights (W8A16). Past
    gemv_ops.MAX_ROWS rows (the `gemv_wide` entry) the first weight tile loads before the PDL wait."""
    from hal.kernels import gemv, gemv_ops

    mode = getattr(gemv, prologue.upper())
    x = torch.empty(num_rows, 2 * k if mode == gemv.SILU_AND_MUL else k, dtype=SHAPE["dtype"])
    weight = torch.empty(n, k, dtype=fp8 or x.dtype)
    out = torch.empty(num_rows, n, dtype=x.dtype)
    rows = torch.empty(num_rows, k, dtype=x.dtype)
    sandwich = mode in (gemv.ADD_NORM, gemv.NORM_ADD)
    return gemv.gemv_launch(
        x, weight, out, config, target, 132, prologue=mode, eps=1e-6,
        norm_weight=torch.empty(k, dtype=x.dtype), residual=rows if sandwich else None,
        res_norm_weight=torch.empty(k, dtype=x.dtype), stream_out=rows if sandwich else None,
        out_residual=torch.empty_like(out) if out_residual else None, workspace=torch.empty(1),
        counters=torch.empty(1, dtype=torch.int32),
        weight_scale=torch.empty(n, dtype=torch.float32) if fp8 is not None else None, preload=num_rows > gemv_ops.MAX_ROWS)


def _gemv_slice(config: KernelConfig, target: str, n: int, k: int, prologue: str, out_residual: bool = False,
                fp8: torch.dtype | None = None, a8: bool = False, tensor_cores: bool = False) -> Launch:
    """A one-row projection of hal/kernels/gemv_slice.py at an Ouro-1.4B shape (split-K for K > block_k);
    `a8` / `tensor_cores`: its tensor-core forms (W8A8 on `fp8` weights, 16-bit)."""
    from hal.kernels import gemv, gemv_slice

    mode = getattr(gemv, prologue.upper())
    x = torch.empty(1, 2 * k if mode == gemv.SILU_AND_MUL else k, dtype=SHAPE["dtype"])
    out = torch.empty(1, n, dtype=x.dtype)
    row = torch.empty(1, k, dtype=x.dtype)
    sandwich = mode in (gemv.ADD_NORM, gemv.NORM_ADD)
    return gemv_slice.slice_gemv_launch(
        x, torch.empty(n, k, dtype=fp8 or x.dtype), out, config, target, prologue=mode, eps=1e-6,
        norm_weight=torch.empty(k, dtype=x.dtype), residual=row if sandwich else None,
        res_norm_weight=torch.empty(k, dtype=x.dtype), stream_out=row if sandwich else None,
        out_residual=torch.empty_like(out) if out_residual else None, workspace=torch.empty(1),
        counters=torch.empty(1, dtype=torch.int32),
        weight_scale=torch.empty(n, dtype=torch.float32) if fp8 is not None else None, a8=a8,
        tensor_cores=tensor_cores)


# one-row whole-slice cases: (name, N, K, prologue, residual epilogue); down splits K
GEMV_SLICE_CASES = (
    ("gemv_slice/o", 2048, 2048, "none", False),
    ("gemv_slice/qkv-rms", 6144, 2048, "rms_norm", False),
    ("gemv_slice/gate_up", 11264, 2048, "none", False),          # its boundary runs before it (lever 61)
    ("gemv_slice/down-silu-res", 2048, 5632, "silu_and_mul", True),
)

# gemv cases: (name, config key, rows, N, K, prologue, residual epilogue); "o" (2048 x 2048) plans split-K
GEMV_CASES = (
    ("gemv_m1/o", "gemv_m1", 1, 2048, 2048, "none", False),
    ("gemv_m1/qkv-rms", "gemv_m1", 1, 6144, 2048, "rms_norm", False),
    ("gemv_m1/gate_up-add_norm", "gemv_m1", 1, 11264, 2048, "add_norm", False),
    ("gemv_m1/down-silu-res", "gemv_m1", 1, 2048, 5632, "silu_and_mul", True),
    ("gemv/qkv-norm_add", "gemv", 8, 6144, 2048, "norm_add", False),
    ("gemv/down-silu-res", "gemv", 8, 2048, 5632, "silu_and_mul", True),
    ("gemv_wide/o-res", "gemv_wide", 64, 2048, 2048, "none", True),
    ("gemv_wide/down-silu", "gemv_wide", 64, 2048, 5632, "silu_and_mul", False),
)

CASES = {c.name: c for c in (
    Case("attention_prefill", "attention_prefill", True, True,
         lambda c, t: _attention(c, t, num_seqs=2, query_len=256, num_splits=1)),
    Case("attention_prefill/own-kv", "attention_prefill", True, True,      # prompts over an FP8 cache
         lambda c, t: _attention(c, t, num_seqs=2, query_len=256, num_splits=1, own_kv=True)),
    Case("attention_decode/split", "attention_decode", True, False,         # batch 1, long context
         lambda c, t: _attention(c, t, num_seqs=1, query_len=1, num_splits=8)),
    Case("attention_decode/batch", "attention_decode", True, False,         # batch 64, no split
         lambda c, t: _attention(c, t, num_seqs=64, query_len=1, num_splits=1)),
    Case("attention_row_decode/split", "attention_row_decode", False, False,
         lambda c, t: _attention(c, t, num_seqs=1, query_len=1, num_splits=8, rows=True)),
    Case("attention_row_decode/batch", "attention_row_decode", False, False,
         lambda c, t: _attention(c, t, num_seqs=64, query_len=1, num_splits=1, rows=True)),
    Case("attention_row_decode/rotary", "attention_row_decode", False, False,
         lambda c, t: _attention(c, t, num_seqs=1, query_len=1, num_splits=8, rows=True, rotary=True)),
    Case("attention_row_decode_split/rotary", "attention_row_decode_split", False, False,
         lambda c, t: _attention(c, t, num_seqs=1, query_len=1, num_splits=8, rows=True, rotary=True)),
    Case("attention_row_decode_split/grouped", "attention_row_decode_split_few", False, False,   # Nanbeige b1
         lambda c, t: _attention(c, t, num_seqs=1, query_len=1, num_splits=8, rows=True, rotary=True,
                                 group=4)),
    Case("attention_prefill_fp32", "attention_prefill_fp32", True, False,   # golden / conformance runs
         lambda c, t: _attention(c, t, num_seqs=2, query_len=256, num_splits=1, dtype=torch.float32)),
    Case("attention_decode_fp32", "attention_decode_fp32", True, False,
         lambda c, t: _attention(c, t, num_seqs=1, query_len=1, num_splits=8, dtype=torch.float32)),
    Case("attention_decode_tma/batch", "attention_decode_tma", True, False,     # Nanbeige b64, bf16
         lambda c, t: _gqa_decode(c, t, None)),
    Case("attention_reduce", "attention_reduce", False, False, _reduce),
    Case("kv_write", "kv_write", False, False, _kv_write),
    Case("rms_norm", "rms_norm", False, False, lambda c, t: _rms_norm(c, t, residual=False)),
    Case("rms_norm/residual", "rms_norm", False, False, lambda c, t: _rms_norm(c, t, residual=True)),
    *(Case(name, "norm_add_norm", False, False, lambda c, t, b=boundary: _norm_add_norm(c, t, b))
      for name, boundary in (("norm_add_norm", "sandwich"), ("norm_add_norm/sum_first", "sum_first"),
                             ("norm_add_norm/pre_norm", "pre_norm"))),
    Case("rotary/neox", "rotary", False, False, lambda c, t: _rotary(c, t, interleaved=False)),
    Case("rotary/gptj", "rotary", False, False, lambda c, t: _rotary(c, t, interleaved=True)),
    Case("silu_and_mul", "silu_and_mul", False, False, _silu_and_mul),
    Case("rotary_kv_write/neox", "rotary", False, False, lambda c, t: _rotary_kv_write(c, t, interleaved=False)),
    Case("rotary_kv_write/gptj", "rotary", False, False, lambda c, t: _rotary_kv_write(c, t, interleaved=True)),
    Case("rotary_kv_write/keep-kv", "rotary", False, False,
         lambda c, t: _rotary_kv_write(c, t, interleaved=False, keep_kv=True)),
    *(Case(name, key, key in ("gemv", "gemv_wide"), key == "gemv_wide",
           lambda c, t, a=(rows, n, k, pro, res): _gemv(c, t, *a[:4], out_residual=a[4]))
      for name, key, rows, n, k, pro, res in GEMV_CASES),
    *(Case(name, "gemv_slice", False, False, lambda c, t, a=(n, k, pro, res): _gemv_slice(c, t, *a[:3],
                                                                                           out_residual=a[3]))
      for name, n, k, pro, res in GEMV_SLICE_CASES),
    # the tensor-core forms (levers 118-119; only the sm_90 table has them): wgmma on e4m3 / bf16 slices
    *(Case(f"{key}/{name.split('/')[1]}", key, True, False,
           lambda c, t, a=(n, k, pro, res), a8=key == "gemv_slice_w8a8": _gemv_slice(
               c, t, *a[:3], out_residual=a[3], fp8=torch.float8_e4m3fn if a8 else None, a8=a8, tensor_cores=not a8))
      for key in ("gemv_slice_w8a8", "gemv_slice_tc")
      for name, n, k, pro, res in GEMV_SLICE_CASES if pro in ("none", "silu_and_mul")),
)}


# FP8 format per target (a gfx942 kernel on e4m3fn values would decode every byte wrongly)
FP8_FORMATS = {"sm_90": torch.float8_e4m3fn, "gfx950": torch.float8_e4m3fn, "gfx942": torch.float8_e4m3fnuz}


def _fp8_cases(fmt: str, fp8: torch.dtype) -> tuple[Case, ...]:
    return (
        Case(f"attention_prefill/{fmt}", "attention_prefill_fp8", True, False,
             lambda c, t: _attention(c, t, num_seqs=2, query_len=256, num_splits=1, kv_dtype=fp8)),
        Case(f"attention_decode/split-{fmt}", "attention_decode_fp8", True, False,
             lambda c, t: _attention(c, t, num_seqs=1, query_len=1, num_splits=8, kv_dtype=fp8)),
        Case(f"attention_decode/batch-{fmt}", "attention_decode_fp8", True, False,
             lambda c, t: _attention(c, t, num_seqs=64, query_len=1, num_splits=1, kv_dtype=fp8)),
        Case(f"attention_row_decode/batch-{fmt}", "attention_row_decode_fp8", False, False,
             lambda c, t: _attention(c, t, num_seqs=64, query_len=1, num_splits=1, kv_dtype=fp8, rows=True)),
        Case(f"attention_decode_tma/batch-{fmt}", "attention_decode_tma_fp8", True, False,    # Nanbeige b64
             lambda c, t: _gqa_decode(c, t, fp8)),
        Case(f"attention_row_decode/rotary-{fmt}", "attention_row_decode_fp8", False, False,
             lambda c, t: _attention(c, t, num_seqs=64, query_len=1, num_splits=1, kv_dtype=fp8, rows=True,
                                     rotary=True)),
        Case(f"attention_row_decode_dense/batch-{fmt}", "attention_row_decode_dense_fp8", False, False,   # b128
             lambda c, t: _attention(c, t, num_seqs=128, query_len=1, num_splits=1, kv_dtype=fp8, rows=True)),
        Case(f"attention_row_decode_split/rotary-{fmt}", "attention_row_decode_split_fp8", False, False,   # b1
             lambda c, t: _attention(c, t, num_seqs=1, query_len=1, num_splits=16, kv_dtype=fp8, rows=True,
                                     rotary=True)),
        Case(f"attention_row_decode_split/grouped-{fmt}", "attention_row_decode_split_few_fp8", False, False,
             lambda c, t: _attention(c, t, num_seqs=1, query_len=1, num_splits=8, kv_dtype=fp8, rows=True,
                                     rotary=True, group=4)),                                # Nanbeige b1
        Case(f"kv_write/{fmt}", "kv_write", False, False, lambda c, t: _kv_write(c, t, kv_dtype=fp8)),
        Case(f"kv_write/dequant-{fmt}", "kv_write", False, False,
             lambda c, t: _kv_write(c, t, kv_dtype=fp8, dequantized=True)),
        Case(f"rotary_kv_write/{fmt}", "rotary", False, False,
             lambda c, t: _rotary_kv_write(c, t, interleaved=False, kv_dtype=fp8)),
        Case(f"fp8_linear/{fmt}", "fp8_linear", True, False, lambda c, t: _fp8_linear(c, t, fp8, num_rows=1)),
        Case(f"fp8_linear_w8a8/{fmt}", "fp8_linear_w8a8", True, False,
             lambda c, t: _fp8_linear_w8a8(c, t, fp8, num_rows=128)),
        Case(f"gemv_m1/qkv-{fmt}", "gemv_m1", False, False,
             lambda c, t: _gemv(c, t, 1, 6144, 2048, "none", fp8=fp8)),
        Case(f"gemv_slice/qkv-{fmt}", "gemv_slice", False, False,
             lambda c, t: _gemv_slice(c, t, 6144, 2048, "none", fp8=fp8)),
        Case(f"gemv/down-res-{fmt}", "gemv", True, False,
             lambda c, t: _gemv(c, t, 8, 2048, 5632, "none", out_residual=True, fp8=fp8)),
        Case(f"fp8_quantize_rows/{fmt}", "rms_norm", False, False, lambda c, t: _quantize_rows(c, t, fp8)),
        Case(f"fp8_silu_mul_quantize_rows/{fmt}", "silu_mul_quantize_rows", False, False,
             lambda c, t: _silu_mul_quantize_rows(c, t, fp8)),
        Case(f"fp8_norm_add_norm_quantize/{fmt}", "norm_add_norm", False, False,
             lambda c, t: _norm_add_norm_quantize(c, t, fp8)),
    )


FP8_CASES_BY_FORMAT = {fp8: {c.name: c for c in _fp8_cases(fmt, fp8)}
                       for fp8, fmt in ((torch.float8_e4m3fn, "e4m3fn"), (torch.float8_e4m3fnuz, "e4m3fnuz"))}
FP8_CASES = {name: case for cases in FP8_CASES_BY_FORMAT.values() for name, case in cases.items()}


def fp8_cases_for(target_name: str) -> list[str]:
    """The FP8 variants compiled for `target_name`, in its format (none where the target has no FP8)."""
    return list(FP8_CASES_BY_FORMAT.get(FP8_FORMATS.get(target_name), {}))


class Report(NamedTuple):
    table: str             # config table ("sm_90", "default", ...) or "custom"
    case: str
    target: str
    config: KernelConfig
    vgpr: int | None       # AMD: VGPRs; NVIDIA: registers per thread
    agpr: int | None
    sgpr: int | None
    spill: int             # AMD: VGPR spills; NVIDIA: spill stack + local bytes
    scratch: int           # AMD: private segment bytes; NVIDIA: local memory bytes
    occupancy: int | None  # AMD: waves per SIMD (compiler); NVIDIA: programs per SM (estimate)
    shared: int            # LDS / shared bytes per program
    mma: str               # matrix instructions found ("v_mfma_f32_16x16x16_bf16", "wgmma", "mma.sync", "-")
    vec16: bool            # 16-byte global loads present
    seconds: float
    problems: tuple[str, ...]


class BoundLaunch(NamedTuple):
    backend: Any                  # triton's compiler backend for the target
    gpu_target: Any               # triton.backends.compiler.GPUTarget
    kwargs: dict[str, Any]        # the launch's constexprs and options, with debug=False
    bound_args: Any
    specialization: list          # per argument: its type and class (see bind_launch)
    options: Any


def bind_launch(launch: Launch, target: Target) -> BoundLaunch:
    """What Triton's launcher computes for `launch` on `target` before it looks up a compiled variant;
    its `specialization` is each argument's type and class (an integer 1, a multiple of 16 or other; a
    pointer 16-byte aligned or not), honouring the kernel's `do_not_specialize` flags."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = launch.kernel
    if not isinstance(fn, JITFunction):
        raise TypeError("xcompile needs compiled kernels: "
                        "unset TRITON_INTERPRET for this process")
    gpu_target = GPUTarget(target.backend, target.arch, target.warp_size)
    backend = make_backend(gpu_target)
    kwargs = {"debug": False, **launch.kwargs}
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    return BoundLaunch(backend, gpu_target, kwargs, bound_args, specialization, options)


def compile_launch(launch: Launch, target: Target):
    """`triton.compile` of `launch` for `target`, specialised as the runtime would specialise it."""
    from triton.compiler import ASTSource, compile

    backend, gpu_target, kwargs, bound_args, specialization, options = bind_launch(launch, target)
    options, signature, constexprs, attrs = launch.kernel._pack_args(backend, kwargs, bound_args, specialization,
                                                                     options)
    return compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=gpu_target,
                   options=options.__dict__)


def _int(pattern: str, text: str) -> int | None:
    match = re.search(pattern, text)
    return int(match.group(1)) if match else None


def _nvidia_resources(cubin: bytes) -> dict[str, int]:
    """REG / STACK / SHARED / LOCAL of a cubin through the cuobjdump that ships with triton."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text)}


def _nvidia_occupancy(regs: int, shared: int, num_warps: int, arch: int) -> int:
    """Programs per SM from registers (allocated per warp in units of 256), shared memory and warps."""
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    smem = (228 if arch >= 90 else 164) * 1024
    by_regs = 65536 // (regs_per_warp * num_warps)
    by_smem = smem // (shared + 1024) if shared else 32      # 1 KiB reserved per program
    return max(min(by_regs, by_smem, 64 // num_warps, 32), 0)


# libdevice's sinf/cosf reduce arguments of 105615 rad and more (Payne-Hanek) through a 28-byte local
# array indexed at run time: a stack frame no register budget removes, used only on that path
# (positions past ~105k at the rotary's first frequency); ptxas keeps it in some kernels and not in others
TRIG_DEPOT_BYTES = 28
TRIG_STACK_BYTES = 32


def _trig_stack_only(ptx: str, stack: int) -> bool:
    """Whether a kernel's whole stack frame is libdevice's trig reduction array (`TRIG_DEPOT_BYTES`)."""
    depots = re.findall(r"__local_depot\d+\[(\d+)\]", ptx)
    return 0 < stack <= TRIG_STACK_BYTES and "__cudart_i2opi_f" in ptx and depots == [str(TRIG_DEPOT_BYTES)]


def _problems(case: Case, target_name: str, config: KernelConfig, r: dict,
              trig_stack: bool = False) -> tuple[str, ...]:
    target, out = TARGETS[target_name], []
    if r["spill"] and not trig_stack:
        out.append(f"register spills ({r['spill']})")
    if r["scratch"]:
        out.append(f"scratch/local memory ({r['scratch']} bytes)")
    if r["shared"] > target.shared_limit:
        out.append(f"shared/LDS {r['shared']} > {target.shared_limit} bytes")
    if case.has_dot and target.backend == "hip" and "mfma" not in r["mma"]:
        out.append("no MFMA for tl.dot")
    if case.has_dot and target.backend == "cuda" and r["mma"] == "-":
        out.append("no MMA for tl.dot")
    if case.wants_wgmma and target_name == "sm_90" and config.block_m >= 64 and "wgmma" not in r["mma"]:
        out.append("no wgmma in the large-tile config")
    return tuple(out)


def compile_case(case_name: str, config: KernelConfig, target_name: str, table: str = "custom") -> Report:
    """Compile one case in one config for one target and check it (cached for the process: tables
    that share a config share the compile)."""
    return _compile_case(case_name, config, target_name)._replace(table=table)


@functools.cache
def _compile_case(case_name: str, config: KernelConfig, target_name: str) -> Report:
    table = "custom"
    case, target = {**CASES, **FP8_CASES}[case_name], TARGETS[target_name]
    start = time.perf_counter()
    try:
        kernel = compile_launch(case.build(config, target.backend), target)
    except Exception as e:  # a config that does not compile is a finding, not a crash of the table
        return Report(table, case_name, target_name, config, None, None, None, 0, 0, None, 0, "-", False,
                      time.perf_counter() - start, (f"compile failed: {type(e).__name__}: {str(e)[:300]}",))
    shared, trig_stack = int(kernel.metadata.shared), False
    if target.backend == "hip":
        asm = kernel.asm["amdgcn"]
        mfma = sorted(set(re.findall(r"v_mfma_\w+", asm)))
        r = dict(vgpr=_int(r"\.vgpr_count:\s*(\d+)", asm), agpr=_int(r"\.agpr_count:\s*(\d+)", asm),
                 sgpr=_int(r"\.sgpr_count:\s*(\d+)", asm),
                 spill=_int(r"\.vgpr_spill_count:\s*(\d+)", asm) or 0,
                 scratch=_int(r"\.private_segment_fixed_size:\s*(\d+)", asm) or 0,
                 occupancy=_int(r";\s*Occupancy:\s*(\d+)", asm), shared=shared, mma=",".join(mfma) or "-",
                 vec16=bool(re.search(r"(global|buffer)_load_dwordx4", asm)))
    else:
        ptx, res = kernel.asm["ptx"], _nvidia_resources(kernel.asm["cubin"])
        mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "-"
        vec16 = bool(re.search(r"ld\.global[.\w]*\.v4\.b32", ptx)) or "cp.async.cg.shared.global" in ptx
        r = dict(vgpr=res.get("REG"), agpr=None, sgpr=None, spill=res.get("STACK", 0),
                 scratch=res.get("LOCAL", 0), shared=shared, mma=mma, vec16=vec16,
                 occupancy=_nvidia_occupancy(res.get("REG", 0), shared, config.num_warps, int(target.arch)))
        trig_stack = _trig_stack_only(ptx, r["spill"])
    return Report(table, case_name, target_name, config, seconds=time.perf_counter() - start,
                  problems=_problems(case, target_name, config, r, trig_stack), **r)


def check_all(tables: dict[str, dict[str, KernelConfig]] | None = None,
              targets: tuple[str, ...] | None = None) -> list[Report]:
    """Every case of every table on the targets that can pick the table (see TABLE_TARGETS)."""
    reports = []
    for table, configs in (tables or all_configs()).items():
        for target_name in TABLE_TARGETS.get(table, tuple(TARGETS)):
            if targets and target_name not in targets:
                continue
            for case in CASES.values():
                if case.config_key in configs:          # optional kernels (configs.OPTIONAL_KERNEL_NAMES)
                    reports.append(compile_case(case.name, configs[case.config_key], target_name, table))
    return reports


def check_fp8(targets: tuple[str, ...] = tuple(FP8_FORMATS)) -> list[Report]:
    """The FP8 variants on each target with FP8, in the target's own arch table."""
    return [compile_case(name, all_configs()[target][FP8_CASES[name].config_key], target, target)
            for target in targets for name in fp8_cases_for(target)
            if FP8_CASES[name].config_key in all_configs()[target]]


def format_rows(reports: list[Report]) -> list[str]:
    rows = []
    for r in reports:
        c = r.config
        tail = r.mma + ("  !! " + "; ".join(r.problems) if r.problems else "")
        rows.append(f"{r.table:8} {r.case:24} {r.target:7} {f'{c.block_m}x{c.block_n}':9} "
                    f"{f'{c.num_warps}/{c.num_stages}':4} {_s(r.vgpr):>5} {_s(r.agpr):>5} {_s(r.sgpr):>5} "
                    f"{r.spill:>5} {r.scratch:>4} {_s(r.occupancy):>4} {r.shared:>7} "
                    f"{'y' if r.vec16 else 'n':3} "
                    f"{r.seconds:5.1f}  {tail}")
    return rows


def with_head(rows: list[str]) -> str:
    """The table around rows of `format_rows` (several processes' rows may be joined first)."""
    head = (f"{'table':8} {'kernel':24} {'target':7} {'M x N':9} {'w/s':4} {'vgpr':>5} {'agpr':>5} "
            f"{'sgpr':>5} {'spill':>5} {'scr':>4} {'occ':>4} {'shared':>7} {'v16':3} {'s':>5}  "
            "mma / problems")
    foot = ("occ: AMD waves/SIMD from the compiler; NVIDIA programs/SM estimated from REG/shared/warps. "
            "v16: 16-byte global loads (or cp.async) present.")
    return "\n".join([head, "-" * len(head), *rows, foot])


def format_table(reports: list[Report]) -> str:
    return with_head(format_rows(reports))


def _s(value: int | None) -> str:
    return "-" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xcompile",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default="", help="comma-separated subset of " + ",".join(TARGETS))
    parser.add_argument("--tables", default="", help="comma-separated subset of " + ",".join(all_configs()))
    parser.add_argument("--fp8", action="store_true", help="also the FP8 variants (FP8 KV, W8A16 linear)")
    args = parser.parse_args(argv)
    tables = all_configs()
    if args.tables:
        tables = {name: tables[name] for name in args.tables.split(",")}
    targets = tuple(args.targets.split(",")) if args.targets else None
    reports = check_all(tables, targets)
    if args.fp8:
        reports += check_fp8(tuple(t for t in FP8_FORMATS if targets is None or t in targets))
    print(format_table(reports))
    bad = [r for r in reports if r.problems]
    print(f"{len(reports)} kernels compiled, {len(bad)} with problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
