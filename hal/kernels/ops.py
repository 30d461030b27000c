"""Fused small ops that dominate a loop at batch 1: RMSNorm (+ residual), a sublayer boundary's
residual add with the norms around it (`norm_add_norm`: sandwich or pre-norm layers), rotary (NeoX
and GPT-J), SiLU-and-mul. Each rounds intermediate results exactly where the torch code in
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

from hal.kernels.configs import KernelConfig, configs_for
from hal.kernels.launch import Launch, backend_of, check_device, launch_options, next_pow2, run_launch

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _normed(x, num_cols, eps, X_DTYPE: tl.constexpr):
    """`x * rsqrt(mean(x^2) + eps)` of a row in float32 (masked columns 0), cast to x's dtype and
    back: zoo's RMSNorm rounds there, before the weight."""
    inv_rms = tl.math.rsqrt(tl.sum(x * x, 0) / num_cols + eps)
    return (x * inv_rms).to(X_DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, weight_ptr, residual_ptr, eps, num_cols, stride_x, stride_r, stride_o,
                     BLOCK: tl.constexpr, X_DTYPE: tl.constexpr, NORM_DTYPE: tl.constexpr,
                     HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    normed = _normed(x, num_cols, eps, X_DTYPE)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (weight * normed).to(NORM_DTYPE)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        y = residual.to(tl.float32) + y.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_add_norm_kernel(y_ptr, h_ptr, x_ptr, residual_ptr, post_weight_ptr, weight_ptr, eps, num_cols,
                          stride_x, stride_r, stride_h, stride_y, BLOCK: tl.constexpr, X_DTYPE: tl.constexpr,
                          MID_DTYPE: tl.constexpr, H_DTYPE: tl.constexpr, NORM_DTYPE: tl.constexpr,
                          HAS_POST: tl.constexpr, SUM_FIRST: tl.constexpr):
    # the residual stream h (one of three boundaries, below), then y = norm(h): each step rounds to
    # the dtype torch's expression rounds to, h included, as the launches it replaces store it
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < num_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_POST:
        post_weight = tl.load(post_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if SUM_FIRST:       # Huginn: h = post_norm(x + residual), the sum (MID_DTYPE) normalised
            total = (x + residual).to(MID_DTYPE).to(tl.float32)
            h = (post_weight * _normed(total, num_cols, eps, MID_DTYPE)).to(H_DTYPE)
        else:               # Ouro: h = residual + post_norm(x), post_norm(x) in MID_DTYPE
            post = (post_weight * _normed(x, num_cols, eps, X_DTYPE)).to(MID_DTYPE).to(tl.float32)
            h = (residual + post).to(H_DTYPE)
    else:                   # pre-norm: h = residual + x
        h = (residual + x).to(H_DTYPE)
    tl.store(h_ptr + row * stride_h + cols, h, mask=mask)               # masked columns are 0 in h
    normed = _normed(h.to(tl.float32), num_cols, eps, H_DTYPE)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (weight * normed).to(NORM_DTYPE)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_one(ptr, out_ptr, stride_t, stride_h, stride_ot, stride_oh, token, cos, sin, num_heads,
                HEADS_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)
    pairs = tl.arange(0, HALF_PAD)
    mask = (heads < num_heads)[:, None] & (pairs < HALF)[None, :]
    src = ptr + token * stride_t + heads[:, None] * stride_h
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh
    dtype = out_ptr.dtype.element_ty
    if INTERLEAVED:     # GPT-J pairs (x[2i], x[2i+1]), all in fp32
        even = tl.load(src + 2 * pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(src + 2 * pairs[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst + 2 * pairs[None, :], (even * cos - odd * sin).to(dtype), mask=mask)
        tl.store(dst + 2 * pairs[None, :] + 1, (even * sin + odd * cos).to(dtype), mask=mask)
    else:               # NeoX pairs (x[i], x[i + D/2]) in x's dtype: x * cos + rotate_half(x) * sin
        first = tl.load(src + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        second = tl.load(src + HALF + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
        c = cos.to(dtype).to(tl.float32)
        s = sin.to(dtype).to(tl.float32)
        out1 = (first * c).to(dtype).to(tl.float32) - (second * s).to(dtype).to(tl.float32)
        out2 = (second * c).to(dtype).to(tl.float32) + (first * s).to(dtype).to(tl.float32)
        tl.store(dst + pairs[None, :], out1.to(dtype), mask=mask)
        tl.store(dst + HALF + pairs[None, :], out2.to(dtype), mask=mask)


@triton.jit
def _rotary_angles(positions_ptr, inv_freq_ptr, token, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """(cos, sin) `[1, HALF_PAD]` of token `token`'s position, angles in fp32 as zoo's tables."""
    pairs = tl.arange(0, HALF_PAD)
    inv_freq = tl.load(inv_freq_ptr + pairs, mask=pairs < HALF, other=0.0)
    angle = tl.load(positions_ptr + token).to(tl.float32) * inv_freq
    return tl.cos(angle)[None, :], tl.sin(angle)[None, :]


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, inv_freq_ptr, num_heads, num_kv_heads,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr,
                   KV_HEADS_PAD: tl.constexpr, INTERLEAVED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _rotary_angles(positions_ptr, inv_freq_ptr, token, HALF, HALF_PAD)
    _rotary_one(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token, cos, sin, num_heads,
                HEADS_PAD, HALF, HALF_PAD, INTERLEAVED)
    _rotary_one(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token, cos, sin, num_kv_heads,
                KV_HEADS_PAD, HALF, HALF_PAD, INTERLEAVED)


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, num_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)         # torch rounds silu first
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(dtype), mask=mask)


@functools.lru_cache(maxsize=64)
def _inv_freq(head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    # exactly zoo.layers.rope_tables' frequencies, computed once per (head dim, theta, device)
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def _config(configs: dict[str, KernelConfig] | None, name: str, fallback: str | None = None) -> KernelConfig:
    """Table entry `name`, or `fallback`'s in a table from before `name` had an entry."""
    table = configs or configs_for("default")
    return table[fallback] if fallback is not None and name not in table else table[name]


def rms_norm_launch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
                    out: torch.Tensor, config: KernelConfig, target: str) -> Launch:
    rows, cols = x.shape                                                  # 2-D views
    norm_dtype = torch.promote_types(x.dtype, weight.dtype)
    res = residual if residual is not None else x
    return Launch(_rms_norm_kernel, (rows,), (
        out, x, weight, res, eps, cols, x.stride(0), res.stride(0), out.stride(0)), dict(
        BLOCK=next_pow2(cols), X_DTYPE=_TL_DTYPES[x.dtype], NORM_DTYPE=_TL_DTYPES[norm_dtype],
        HAS_RESIDUAL=residual is not None, **launch_options(config, target)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             configs: dict[str, KernelConfig] | None = None) -> torch.Tensor:
    """Llama RMSNorm of `x: [..., N]` (fp32 math, cast to x.dtype, then * weight); with `residual`
    (same shape) returns `residual + norm(x)`. Output dtype as torch's promotion of the operands."""
    check_device(x)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dtype = torch.promote_types(x.dtype, weight.dtype)
    res2 = None
    if residual is not None:
        dtype = torch.promote_types(dtype, residual.dtype)
        res2 = residual.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape, dtype=dtype, device=x.device)
    if x2.shape[0]:
        run_launch(rms_norm_launch(x2, weight.contiguous(), eps, res2, out, _config(configs, "rms_norm"),
                                   backend_of(x.device)))
    return out.view(x.shape)


def _stream_dtypes(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                   sum_first: bool) -> tuple[torch.dtype, torch.dtype]:
    """(the intermediate's dtype, h's) as torch promotes them in the boundary's expression: the
    post-norm output (`residual + post_norm(x)`) or the sum (`post_norm(x + residual)`), then h."""
    promote = torch.promote_types
    if post_weight is None:
        return x.dtype, promote(x.dtype, residual.dtype)
    if sum_first:
        total = promote(x.dtype, residual.dtype)
        return total, promote(total, post_weight.dtype)
    post = promote(x.dtype, post_weight.dtype)
    return post, promote(post, residual.dtype)


def norm_add_norm_launch(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                         weight: torch.Tensor, eps: float, y: torch.Tensor, h: torch.Tensor,
                         config: KernelConfig, target: str, sum_first: bool = False) -> Launch:
    rows, cols = x.shape                                                  # 2-D views
    mid_dtype, _ = _stream_dtypes(x, residual, post_weight, sum_first)
    post = post_weight if post_weight is not None else weight            # not read without a post-norm
    return Launch(_norm_add_norm_kernel, (rows,), (
        y, h, x, residual, post, weight, eps, cols, x.stride(0), residual.stride(0), h.stride(0),
        y.stride(0)), dict(
        BLOCK=next_pow2(cols), X_DTYPE=_TL_DTYPES[x.dtype], MID_DTYPE=_TL_DTYPES[mid_dtype],
        H_DTYPE=_TL_DTYPES[h.dtype], NORM_DTYPE=_TL_DTYPES[y.dtype], HAS_POST=post_weight is not None,
        SUM_FIRST=sum_first and post_weight is not None, **launch_options(config, target)))


def norm_add_norm(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                  weight: torch.Tensor, eps: float, sum_first: bool = False,
                  configs: dict[str, KernelConfig] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(y, h)`, `x, residual: [..., N]`: a sublayer boundary's residual stream h and the next
    sublayer's input `y = rms_norm(h, weight, eps)` in one launch, h one of
    - `residual + rms_norm(x, post_weight, eps)` (sandwich norms, Ouro),
    - `rms_norm(x + residual, post_weight, eps)` with `sum_first` (Huginn's sandwich block),
    - `residual + x` with `post_weight=None` (pre-norm layers; `sum_first` does not apply).
    Dtypes as torch's promotion in those expressions; y of h and weight."""
    check_device(x)
    if residual.shape != x.shape:
        raise ValueError(f"norm_add_norm needs x and residual of one shape, got {tuple(x.shape)} "
                         f"and {tuple(residual.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    res2 = residual.reshape(-1, x.shape[-1]).contiguous()
    _, h_dtype = _stream_dtypes(x, residual, post_weight, sum_first)
    h = torch.empty(x2.shape, dtype=h_dtype, device=x.device)
    y = torch.empty(x2.shape, dtype=torch.promote_types(h_dtype, weight.dtype), device=x.device)
    if x2.shape[0]:
        config = _config(configs, "norm_add_norm", fallback="rms_norm")
        post = post_weight.contiguous() if post_weight is not None else None
        run_launch(norm_add_norm_launch(x2, res2, post, weight.contiguous(), eps, y, h, config,
                                        backend_of(x.device), sum_first))
    return y.view(x.shape), h.view(x.shape)


def rotary_launch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                  q_out: torch.Tensor, k_out: torch.Tensor, interleaved: bool, config: KernelConfig,
                  target: str) -> Launch:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    return Launch(_rotary_kernel, (num_tokens,), (
        q, k, q_out, k_out, positions, inv_freq, num_heads, num_kv_heads, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1)), dict(
        HALF=head_dim // 2, HALF_PAD=next_pow2(head_dim // 2), HEADS_PAD=next_pow2(num_heads),
        KV_HEADS_PAD=next_pow2(num_kv_heads), INTERLEAVED=interleaved, **launch_options(config, target)))


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
                                 interleaved, _config(configs, "rotary"), backend_of(q.device)))
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
        run_launch(silu_and_mul_launch(x2, out, _config(configs, "silu_and_mul"), backend_of(x.device)))
    return out.view(*x.shape[:-1], x.shape[-1] // 2)


def fused_ops(configs: dict[str, KernelConfig] | None = None) -> dict[str, Callable]:
    """The ops by the names `Hal.op` uses, bound to one config table."""
    return {"rms_norm": functools.partial(rms_norm, configs=configs),
            "norm_add_norm": functools.partial(norm_add_norm, configs=configs),
            "rotary": functools.partial(rotary, configs=configs),
            "silu_and_mul": functools.partial(silu_and_mul, configs=configs)}
