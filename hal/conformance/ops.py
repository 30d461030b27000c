"""The fused-op check (level R2): every op a Hal offers through `op(name)` equals its plain torch
expression, computed here in float64, on fresh random inputs in float32 and bf16.

Signatures: see `hal.base.Hal.op` (`rms_norm(x, weight, eps, residual=None)` returns
`residual + norm(x)` with a residual; `norm_add_norm(x, residual, post_weight, weight, eps, sum_first)`
returns `(norm(h), h)`, `h = residual + norm(x)`, `norm(x + residual)` with `sum_first`, `residual + x`
without `post_weight`; `rotary` returns `(q, k)`, possibly rotated in place).
"""
from __future__ import annotations

import torch

from hal.base import Hal
from hal.conformance.attention_checks import TOLERANCE, _max_err


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def rotary_ref(x: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor:
    """`x: [T, H, D]` rotated by `positions: [T]`: pairs (2i, 2i+1) if interleaved, else (i, i + D/2)."""
    head_dim = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.double()[:, None, None] * inv_freq                 # [T, 1, D/2]
    x = x.double()
    first, second = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    out_first = first * angles.cos() - second * angles.sin()
    out_second = second * angles.cos() + first * angles.sin()
    if interleaved:
        return torch.stack([out_first, out_second], dim=-1).flatten(-2)
    return torch.cat([out_first, out_second], dim=-1)


def _assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = _max_err(out, ref)
    bound = TOLERANCE[dtype] * (1 + ref.abs().max().item())
    assert out.shape == ref.shape and err <= bound, (f"{name} {dtype}: shape {tuple(out.shape)}, "
                                                     f"max error {err:.2e} > {bound:.2e}")


def check_fused_ops(hal: Hal) -> str:
    """The fused ops a Hal offers through `op(name)` equal their plain torch expressions."""
    offered = [n for n in ("rms_norm", "norm_add_norm", "silu_and_mul", "rotary") if hal.op(n) is not None]
    if not offered:
        return "no fused ops offered (callers use torch)"
    device = hal.device()
    for dtype in [d for d in (torch.float32, torch.bfloat16) if d in hal.caps.dtypes]:
        if "rms_norm" in offered:
            x, weight = torch.randn(7, 96, dtype=dtype), torch.rand(96, dtype=dtype) + 0.5
            out = hal.op("rms_norm")(x.to(device), weight.to(device), 1e-6)
            _assert_close("rms_norm", out, rms_norm_ref(x, weight, 1e-6), dtype)
            residual = torch.randn(7, 96, dtype=dtype)
            out = hal.op("rms_norm")(x.to(device), weight.to(device), 1e-6, residual.to(device))
            _assert_close("rms_norm(residual)", out, residual.double() + rms_norm_ref(x, weight, 1e-6), dtype)
        if "norm_add_norm" in offered:
            x, residual = torch.randn(7, 96, dtype=dtype), torch.randn(7, 96, dtype=dtype)
            post_weight, weight = torch.rand(96, dtype=dtype) + 0.5, torch.rand(96, dtype=dtype) + 0.5
            x_dev, res_dev, post_dev, w_dev = (t.to(device) for t in (x, residual, post_weight, weight))
            # the three boundaries: sandwich (Ouro), sum first (Huginn), pre-norm (no post-norm)
            total = x.double() + residual.double()
            for kind, post, sum_first, h_ref in (
                    ("", post_dev, False, residual.double() + rms_norm_ref(x, post_weight, 1e-6)),
                    ("(sum_first)", post_dev, True, rms_norm_ref(total, post_weight, 1e-6)),
                    ("(pre-norm)", None, False, total)):
                y, h = hal.op("norm_add_norm")(x_dev, res_dev, post, w_dev, 1e-6, sum_first=sum_first)
                _assert_close(f"norm_add_norm{kind} h", h, h_ref, dtype)
                _assert_close(f"norm_add_norm{kind} y", y, rms_norm_ref(h_ref, weight, 1e-6), dtype)
        if "silu_and_mul" in offered:
            x = torch.randn(7, 2 * 80, dtype=dtype)
            ref = torch.nn.functional.silu(x[:, :80].double()) * x[:, 80:].double()
            _assert_close("silu_and_mul", hal.op("silu_and_mul")(x.to(device)), ref, dtype)
        if "rotary" in offered:
            q = torch.randn(9, 4, 64, dtype=dtype)                                   # [T, H, D]
            k = torch.randn(9, 2, 64, dtype=dtype)                                   # [T, KVH, D]
            positions = torch.randint(0, 512, (9,))         # small angles: float32 phase error stays tiny
            for interleaved in (False, True):
                q_dev, k_dev = q.to(device, copy=True), k.to(device, copy=True)
                out = hal.op("rotary")(q_dev, k_dev, positions.to(device), 1e4, interleaved)
                outs = out if isinstance(out, (tuple, list)) else (q_dev, k_dev)   # returned, or in place
                for name, x, x_out in (("q", q, outs[0]), ("k", k, outs[1])):
                    ref = rotary_ref(x, positions, 1e4, interleaved)
                    _assert_close(f"rotary(interleaved={interleaved}) {name}", x_out, ref, dtype)
    return f"checked {', '.join(offered)}"
