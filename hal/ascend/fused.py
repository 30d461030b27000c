"""The fused small ops `AscendHal.op(name)` returns, over torch_npu's kernels (through `AscendOps`).

Signatures (shared with the other Hals):
- `rms_norm(x, weight, eps, residual=None)`: `x: [..., X]`, `weight: [X]`. Returns `y` (x's dtype),
  or with a residual `residual + rms_norm(x)` (see `hal.base.Hal.op`).
- `rotary(q, k, positions, theta, interleaved)`: `q: [..., H, D]`, `k: [..., KVH, D]`, `positions`
  the leading dims of q (int). NeoX halves, or GPT-J adjacent pairs when `interleaved`. Returns
  the rotated `(q, k)`; q and k themselves may be overwritten (the NPU kernel works in place).
- `silu_and_mul(x)`: `x: [..., 2n]` -> `silu(x[..., :n]) * x[..., n:]`.
- `norm_add_norm(x, residual, post_weight, weight, eps, sum_first=False)`: `(rms_norm(h, weight), h)`
  with `h = residual + rms_norm(x, post_weight)` (sandwich norms: npu_rms_norm, then
  npu_add_rms_norm), `h = rms_norm(x + residual, post_weight)` with `sum_first` (Huginn:
  npu_add_rms_norm, then npu_rms_norm), or `h = residual + x` with `post_weight=None` (pre-norm
  layers: npu_add_rms_norm alone).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from hal.ascend.ops import AscendOps

# npu_apply_rotary_pos_emb on Atlas A2 (910B): "half" mode, head dim 64 or 128; npu_rotary_mul otherwise
ROTARY_QK_HEAD_DIMS = (64, 128)


def rms_norm(ops: AscendOps, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> Any:
    gamma = weight.to(x.dtype)                    # the kernel wants gamma in the input's dtype
    y = ops.rms_norm(x, gamma, eps)
    y = y[0] if isinstance(y, (tuple, list)) else y
    # npu_add_rms_norm normalises x + residual (pre-norm: `add_rms_norm` below); this is the add after
    return y if residual is None else residual + y


def _add_rms_norm(ops: AscendOps, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # `(rms_norm(x + residual), x + residual)`: npu_add_rms_norm, the sum in x's dtype
    return ops.add_rms_norm(x, residual.to(x.dtype), weight.to(x.dtype), eps)


def norm_add_norm(ops: AscendOps, x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor | None,
                  weight: torch.Tensor, eps: float, sum_first: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    # npu_add_rms_norm normalises a sum and returns it too: one kernel where the unfused path takes
    # two (add, norm), two where it takes three (norm, add, norm); every add is in x's dtype
    if post_weight is None:
        return _add_rms_norm(ops, x, residual, weight, eps)
    if sum_first:
        h, _ = _add_rms_norm(ops, x, residual, post_weight, eps)
        return rms_norm(ops, h, weight, eps), h
    post = rms_norm(ops, x, post_weight, eps)
    return _add_rms_norm(ops, post, residual, weight, eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[T, D/2]` float32 of `positions: [T]` (the zoo's rope_tables formula)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / theta ** exponents
    angles = positions.float()[:, None] * inv_freq
    return angles.cos(), angles.sin()


def rotary(ops: AscendOps, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float,
           interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim or k.shape[:-2] != q.shape[:-2] or positions.shape != q.shape[:-2]:
        raise ValueError(f"rotary: q {tuple(q.shape)}, k {tuple(k.shape)} and positions "
                         f"{tuple(positions.shape)} must share the leading dims and the head dim")
    cos, sin = rope_cos_sin(positions.reshape(-1), head_dim, theta)                  # [T, D/2]
    if interleaved:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)      # angle i at 2i, 2i+1
    else:
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)            # angle i at i, i + D/2
    cos, sin = cos[None, :, None].to(q.dtype), sin[None, :, None].to(q.dtype)      # [1, T, 1, D]
    q4 = q.reshape(1, -1, q.shape[-2], head_dim).contiguous()                       # BSND, B = 1, S = T
    k4 = k.reshape(1, -1, k.shape[-2], head_dim).contiguous()
    if not interleaved and head_dim in ROTARY_QK_HEAD_DIMS:
        q4, k4 = ops.rotary_qk(q4, k4, cos, sin)
    else:
        mode = "interleave" if interleaved else "half"
        q4, k4 = ops.rotary_one(q4, cos, sin, mode), ops.rotary_one(k4, cos, sin, mode)
    return q4.reshape(q.shape), k4.reshape(k.shape)


def silu_and_mul(ops: AscendOps, x: torch.Tensor) -> torch.Tensor:
    return ops.swiglu(x)


OPS: dict[str, Callable[..., Any]] = {"rms_norm": rms_norm, "rotary": rotary, "silu_and_mul": silu_and_mul,
                                      "norm_add_norm": norm_add_norm}


def make_op(name: str, ops: AscendOps) -> Callable[..., Any] | None:
    fn = OPS.get(name)
    return functools.partial(fn, ops) if fn is not None else None
