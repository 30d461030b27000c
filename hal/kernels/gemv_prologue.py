"""The input side of the decode GEMV (hal/kernels/gemv.py): the op folded in before a projection.

Prologues (`PROLOGUE`, what the kernel feeds the product instead of x; every step rounds where
zoo/layers.py rounds, so the input equals the unfused torch input up to the rounding of the fp32
row statistics):
  0 NONE          x
  1 RMS_NORM      norm(x; w_in)                                 (pre-norm projections)
  2 SILU_AND_MUL  silu(x[:, :K]) * x[:, K:]                     (the down projection after gate|up)
  3 ADD_NORM      h = r + norm(x; w_res); norm(h; w_in)         (Ouro's sandwich: post-norm, then pre-norm)
  4 NORM_ADD      h = norm(x + r; w_res); norm(h; w_in)         (Huginn's sandwich block)
with norm(v; w) = w * (v * rsqrt(mean(v^2) + eps)).to(dtype) (Llama RMSNorm). ADD_NORM and NORM_ADD
also write the residual stream h (the programs of the first column block do, for their K range).
"""
from __future__ import annotations

import triton
import triton.language as tl

NONE, RMS_NORM, SILU_AND_MUL, ADD_NORM, NORM_ADD = 0, 1, 2, 3, 4      # PROLOGUE (the kernels test 3, 4)


@triton.jit
def _norm(v, inv, w_ptr, ks, k_mask, DT: tl.constexpr):
    """Llama RMSNorm's rounding: `v * inv` in fp32, cast to DT, times the weight, cast to DT.
    v `[R, K]` fp32, inv `[R]`; returns fp32 values representable in DT."""
    w = tl.load(w_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
    return (w[None, :] * (v * inv[:, None]).to(DT).to(tl.float32)).to(DT).to(tl.float32)


@triton.jit
def _stream_of(x, r, inv_src, res_norm_ptr, ks, k_mask, PROLOGUE: tl.constexpr, DT: tl.constexpr):
    """The residual stream h of ADD_NORM (`r + norm(x)`) or NORM_ADD (`norm(x + r)`) from x, r (fp32)."""
    if PROLOGUE == 3:
        h = (r + _norm(x, inv_src, res_norm_ptr, ks, k_mask, DT)).to(DT).to(tl.float32)
    else:
        h = _norm((x + r).to(DT).to(tl.float32), inv_src, res_norm_ptr, ks, k_mask, DT)
    return h


@triton.jit
def _stream(x_ptr, res_ptr, res_norm_ptr, rows, ks, mask, k_mask, inv_src, stride_xm, stride_rm,
            PROLOGUE: tl.constexpr, DT: tl.constexpr):
    """h (see `_stream_of`) at [rows, ks], loaded from x and r."""
    x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + rows[:, None] * stride_rm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    return _stream_of(x, r, inv_src, res_norm_ptr, ks, k_mask, PROLOGUE, DT)


@triton.jit
def _row_stats(x_ptr, res_ptr, res_norm_ptr, rows, row_mask, K, eps, stride_xm, stride_rm,
               PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr, STATS_BLOCK: tl.constexpr,
               ONE_PASS: tl.constexpr, DT: tl.constexpr):
    """rsqrt(mean(v^2) + eps) per row: (inv_src, inv_stream). inv_src is that of x (RMS_NORM,
    ADD_NORM) or of x + r (NORM_ADD); inv_stream that of the residual stream h (ADD_NORM, NORM_ADD).
    With ONE_PASS the rows fit one STATS_BLOCK tile: loaded once, both statistics from registers
    (one L2 round trip before the product can start, not two)."""
    if ONE_PASS:
        ks = tl.arange(0, STATS_BLOCK)
        k_mask = ks < K
        mask = row_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        v = x
        r = x
        if PROLOGUE >= 3:
            r = tl.load(res_ptr + rows[:, None] * stride_rm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        if PROLOGUE == 4:
            v = (x + r).to(DT).to(tl.float32)
        inv_src = tl.math.rsqrt(tl.sum(v * v, 1) / K + eps)
        inv_stream = inv_src
        if PROLOGUE >= 3:
            h = _stream_of(x, r, inv_src, res_norm_ptr, ks, k_mask, PROLOGUE, DT)
            inv_stream = tl.math.rsqrt(tl.sum(h * h, 1) / K + eps)
    else:
        sq = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, STATS_BLOCK):
            ks = k0 + tl.arange(0, STATS_BLOCK)
            k_mask = ks < K
            mask = row_mask[:, None] & k_mask[None, :]
            v = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            if PROLOGUE == 4:
                r = tl.load(res_ptr + rows[:, None] * stride_rm + ks[None, :], mask=mask, other=0.0)
                v = (v + r.to(tl.float32)).to(DT).to(tl.float32)
            sq += tl.sum(v * v, 1)
        inv_src = tl.math.rsqrt(sq / K + eps)
        inv_stream = inv_src
        if PROLOGUE >= 3:
            sq = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, STATS_BLOCK):
                ks = k0 + tl.arange(0, STATS_BLOCK)
                k_mask = ks < K
                mask = row_mask[:, None] & k_mask[None, :]
                h = _stream(x_ptr, res_ptr, res_norm_ptr, rows, ks, mask, k_mask, inv_src, stride_xm, stride_rm,
                            PROLOGUE, DT)
                sq += tl.sum(h * h, 1)
            inv_stream = tl.math.rsqrt(sq / K + eps)
    return inv_src, inv_stream


@triton.jit
def _input_tile(x_ptr, res_ptr, in_norm_ptr, res_norm_ptr, stream_ptr, rows, row_mask, ks, k_mask, K,
                inv_src, inv_stream, stream_rows, stride_xm, stride_rm, stride_sm,
                PROLOGUE: tl.constexpr, DT: tl.constexpr):
    """What the product reads instead of x at [rows, ks]: `[R, BLOCK_K]` in DT."""
    mask = row_mask[:, None] & k_mask[None, :]
    src = x_ptr + rows[:, None] * stride_xm + ks[None, :]
    if PROLOGUE == 0:
        a = tl.load(src, mask=mask, other=0.0)
    elif PROLOGUE == 1:
        a = _norm(tl.load(src, mask=mask, other=0.0).to(tl.float32), inv_src, in_norm_ptr, ks, k_mask, DT)
    elif PROLOGUE == 2:
        gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + K, mask=mask, other=0.0).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(DT).to(tl.float32)     # torch rounds silu first
        a = act * up
    else:
        h = _stream(x_ptr, res_ptr, res_norm_ptr, rows, ks, mask, k_mask, inv_src, stride_xm, stride_rm,
                    PROLOGUE, DT)
        tl.store(stream_ptr + rows[:, None] * stride_sm + ks[None, :], h.to(DT),
                 mask=(rows < stream_rows)[:, None] & k_mask[None, :])
        a = _norm(h, inv_stream, in_norm_ptr, ks, k_mask, DT)
    return a.to(DT)
