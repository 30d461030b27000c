"""Fused small ops that dominate a loop at batch 1: rotary (NeoX and GPT-J) and SiLU-and-mul here,
the norms in hal/kernels/norms.py (RMSNorm (+ residual); `norm_add_norm`, a sublayer boundary's
residual add with the norms around it). Each rounds intermediate results exactly where the torch code in
zoo/layers.py does (`reference.py` restates it), so bf16 outputs match it to the last bit up to the
rounding of fp32 transcendentals and reduction order.

The Hals expose these through `Hal.op(name)` (`fused_ops()`); a `configs` table picks the launch
options (`configs_for(arch)`), defaulting to the "default" table.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from hal.kernels.configs import KernelConfig, config_or_default
from hal.kernels.launch import (EXACT_ROUNDING, Launch, backend_of, check_device, launch_options, next_pow2,
                               run_launch)
from hal.kernels.norms import norm_add_norm, rms_norm
from hal.kernels.pdl import pdl_wait


@triton.jit
def _rotary_values(ptr, stride_t, stride_h, token, cos, sin, num_heads, HEADS_PAD: tl.constexpr,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr, dtype: tl.constexpr):
    """Token `token`'s heads `[HEADS_PAD, HALF_PAD]` x 2 rotated, each value rounded to `dtype` and
    widened back to fp32 (masked lanes 0): (x[i], x[i + D/2]) rotated for NeoX, (x[2i], x[2i+1]) for
    GPT-J; and the mask."""
    heads = tl.arange(0, HEADS_PAD)
    pairs = tl.arange(0, HALF_PAD)
    mask = (heads < num_heads)[:, None] & (pairs < HALF)[None, :]
    src = ptr + token * stride_t + heads[:, None] * stride_h
    if INTERLEAVED:     # GPT-J pairs (x[2i], x[2i+1]), all in fp32
        even = tl.load(src + 2 * pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(src + 2 * pairs[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
        first = (even * cos - odd * sin).to(dtype).to(tl.float32)
        second = (even * sin + odd * cos).to(dtype).to(tl.float32)
    else:               # NeoX pairs (x[i], x[i + D/2]) in x's dtype: x * cos + rotate_half(x) * sin
        x1 = tl.load(src + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        c = cos.to(dtype).to(tl.float32)
        s = sin.to(dtype).to(tl.float32)
        first = ((x1 * c).to(dtype).to(tl.float32) - (x2 * s).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        second = ((x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return first, second, mask


@triton.jit
def _rotary_offsets(HALF: tl.constexpr, HALF_PAD: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Where `_rotary_values`' two halves go along D: `[1, HALF_PAD]` each."""
    pairs = tl.arange(0, HALF_PAD)[None, :]
    if INTERLEAVED:
        return 2 * pairs, 2 * pairs + 1
    return pairs, HALF + pairs


@triton.jit
def _head_angles(pos, inv_freq_ptr, dims, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(cos, sin) of position `pos` for each lane of a head laid out along `dims` `[D_pad]` as in
    memory, computed as `_rotary_angles` computes them for the lane's pair."""
    pair = dims // 2 if INTERLEAVED else tl.where(dims < HALF, dims, dims - HALF)
    angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + pair, mask=dims < 2 * HALF, other=0.0)
    return tl.cos(angle), tl.sin(angle)


@triton.jit
def _rotated_head(src, cos, sin, dims, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, dtype: tl.constexpr):
    """One head's vector at `src` rotated (`_head_angles`), laid out along `dims` as in memory (0 past
    D): the values of `_rotary_values` to the bit (the same expressions per lane, each lane reading
    its pair's other value itself), for kernels that hold a head as one vector."""
    valid = dims < 2 * HALF
    partner = dims ^ 1 if INTERLEAVED else tl.where(dims < HALF, dims + HALF, dims - HALF)
    x = tl.load(src + dims, mask=valid, other=0.0).to(tl.float32)
    p = tl.load(src + partner, mask=valid, other=0.0).to(tl.float32)
    if INTERLEAVED:     # (even * cos - odd * sin, even * sin + odd * cos), fp32 math
        out = tl.where(dims % 2 == 0, x * cos - p * sin, p * sin + x * cos)
    else:               # NeoX: every product rounded to dtype, as x * cos + rotate_half(x) * sin
        c = cos.to(dtype).to(tl.float32)
        s = sin.to(dtype).to(tl.float32)
        xc = (x * c).to(dtype).to(tl.float32)
        ps = (p * s).to(dtype).to(tl.float32)
        out = tl.where(dims < HALF, xc - ps, xc + ps)
    return out.to(dtype).to(tl.float32)


@triton.jit
def _rotary_one(ptr, out_ptr, stride_t, stride_h, stride_ot, stride_oh, token, cos, sin, num_heads,
                HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    dtype = out_ptr.dtype.element_ty
    first, second, mask = _rotary_values(ptr, stride_t, stride_h, token, cos, sin, num_heads, HEADS_PAD, HALF,
                                         HALF_PAD, INTERLEAVED, dtype)
    at_first, at_second = _rotary_offsets(HALF, HALF_PAD, INTERLEAVED)
    dst = out_ptr + token * stride_ot + tl.arange(0, HEADS_PAD)[:, None] * stride_oh
    tl.store(dst + at_first, first.to(dtype), mask=mask)
    tl.store(dst + at_second, second.to(dtype), mask=mask)


@triton.jit
def _rotary_angles(positions_ptr, inv_freq_ptr, token, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """(cos, sin) `[1, HALF_PAD]` of token `token`'s position, angles in fp32 as zoo's tables."""
    pairs = tl.arange(0, HALF_PAD)
    inv_freq = tl.load(inv_freq_ptr + pairs, mask=pairs < HALF, other=0.0)
    angle = tl.load(positions_ptr + token).to(tl.float32) * inv_freq
    return tl.cos(angle)[None, :], tl.sin(angle)[None, :]


@triton.jit
def _rotary_program_queries(q_ptr, q_out_ptr, positions_ptr, inv_freq_ptr, num_heads, stride_qt, stride_qh,
                            stride_qot, stride_qoh, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                            HEADS_PAD: tl.constexpr, KV_HEADS_PAD: tl.constexpr, INTERLEAVED: tl.constexpr,
                            PDL: tl.constexpr):
    """The start of a rotary program (t, g) (`rotary_head_groups`): token t's angles, the PDL wait (the
    angles come from the step's positions, which no kernel of the step writes: hal/kernels/pdl.py),
    then its query heads [g * HEADS_PAD, ...) rotated; returns (t, the group's first KV head
    g * KV_HEADS_PAD, cos, sin)."""
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    q_head = group * HEADS_PAD
    cos, sin = _rotary_angles(positions_ptr, inv_freq_ptr, token, HALF, HALF_PAD)
    pdl_wait(PDL)
    _rotary_one(q_ptr + q_head * stride_qh, q_out_ptr + q_head * stride_qoh, stride_qt, stride_qh, stride_qot,
                stride_qoh, token, cos, sin, num_heads - q_head, HEADS_PAD, HALF, HALF_PAD, INTERLEAVED)
    return token, group * KV_HEADS_PAD, cos, sin


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, inv_freq_ptr, num_heads, num_kv_heads,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                   KV_HEADS_PAD: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr = False):
    """Program (t, g): token t's query heads [g * HEADS_PAD, ...) and key heads [g * KV_HEADS_PAD, ...)."""
    token, kv_head, cos, sin = _rotary_program_queries(q_ptr, q_out_ptr, positions_ptr, inv_freq_ptr, num_heads,
                                                       stride_qt, stride_qh, stride_qot, stride_qoh, HALF, HALF_PAD,
                                                       HEADS_PAD, KV_HEADS_PAD, INTERLEAVED, PDL)
    _rotary_one(k_ptr + kv_head * stride_kh, k_out_ptr + kv_head * stride_koh, stride_kt, stride_kh, stride_kot,
                stride_koh, token, cos, sin, num_kv_heads - kv_head, KV_HEADS_PAD, HALF, HALF_PAD, INTERLEAVED)


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, num_cols, stride_x, stride_o, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    tl.store(out_ptr + row * stride_o + cols, silu_mul_row(x_ptr + row * stride_x, cols, mask, num_cols,
                                                           out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul_row(row_ptr, cols, mask, num_cols, dtype: tl.constexpr):
    """`silu(gate) * up` at `cols` of one row `gate | up` (each `num_cols` wide), rounded to `dtype` as torch
    rounds it (silu first): the silu_and_mul kernel's values, which hal/kernels/fp8_rows.py's fused
    quantization must reproduce."""
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)         # torch rounds silu first
    return (act * up).to(dtype)


@functools.lru_cache(maxsize=64)
def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    # exactly zoo.rope.rope_tables' frequencies, computed once per (head dim, theta, device)
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


GROUPED_ROTARY_MAX_TOKENS = 256    # fewer tokens: a token's heads spread over several programs
HEADS_PER_GROUP = 4


def rotary_head_groups(num_tokens: int, num_heads: int, num_kv_heads: int) -> tuple[int, int, int]:
    """(query heads, key heads, groups) per token's programs. One program per token holds every head
    where the tokens fill the GPU; a few tokens (decode) spread their heads over several programs:
    one program rotating Huginn's 55 + 55 heads of 96 took 22.8 us on the H200 (2026-12-02)."""
    if num_tokens >= GROUPED_ROTARY_MAX_TOKENS or num_heads <= HEADS_PER_GROUP:
        return next_pow2(num_heads), next_pow2(num_kv_heads), 1
    groups = -(-num_heads // HEADS_PER_GROUP)
    return HEADS_PER_GROUP, next_pow2(-(-num_kv_heads // groups)), groups


def rotary_launch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  q_out: torch.Tensor, k_out: torch.Tensor, interleaved: bool, config: KernelConfig,
                  target: str) -> Launch:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    heads, kv_heads, groups = rotary_head_groups(num_tokens, num_heads, num_kv_heads)
    return Launch(_rotary_kernel, (num_tokens, groups), (
        q, k, q_out, k_out, positions, inv_freq, num_heads, num_kv_heads, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1)), dict(
        HALF=head_dim // 2, HALF_PAD=next_pow2(head_dim // 2), HEADS_PAD=heads,
        KV_HEADS_PAD=kv_heads, INTERLEAVED=interleaved, **EXACT_ROUNDING, **launch_options(config, target)))


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool,
           configs: dict[str, KernelConfig] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of `q: [T, H, D]` and `k: [T, KVH, D]` at `positions: [T]`; new tensors.
    `interleaved=False`: NeoX/Llama "rotate_half"; True: GPT-J adjacent pairs (fp32 math)."""
    check_device(q)
    head_dim = q.shape[-1]
    if head_dim % 2 or k.shape[-1] != head_dim:
        raise ValueError(f"rotary needs q and k with one even head dim, got {q.shape} and {k.shape}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0]:
        run_launch(rotary_launch(q, k, positions, _inv_freq(head_dim, float(theta), q.device), q_out, k_out,
                                 interleaved, config_or_default(configs, "rotary"), backend_of(q.device)))
    return q_out, k_out


def silu_and_mul_launch(x: torch.Tensor, out: torch.Tensor, config: KernelConfig, target: str) -> Launch:
    rows, cols = out.shape
    block = min(config.block_n, next_pow2(cols))
    return Launch(_silu_and_mul_kernel, (rows, -(-cols // block)), (out, x, cols, x.stride(0), out.stride(0)),
                  dict(BLOCK=block, **launch_options(config, target)))


def silu_and_mul(x: torch.Tensor, configs: dict[str, KernelConfig] | None = None) -> torch.Tensor:
    """`x: [..., 2I]` = gate | up -> `silu(gate) * up: [..., I]` in x's dtype."""
    check_device(x)
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate | up), got {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], x2.shape[1] // 2, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        run_launch(silu_and_mul_launch(x2, out, config_or_default(configs, "silu_and_mul"), backend_of(x.device)))
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def fused_ops(configs: dict[str, KernelConfig] | None = None) -> dict[str, Callable]:
    """The ops by the names `Hal.op` uses, bound to one config table."""
    return {"rms_norm": functools.partial(rms_norm, configs=configs),
            "norm_add_norm": functools.partial(norm_add_norm, configs=configs),
            "rotary": functools.partial(rotary, configs=configs),
            "silu_and_mul": functools.partial(silu_and_mul, configs=configs)}
