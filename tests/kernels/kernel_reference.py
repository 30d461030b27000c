"""Plain-torch references of every kernel in hal/kernels: the definition the kernels are tested
against (paged attention's reference is `hal.common.torch_attention.TorchPagedAttention`).

The formulas and their rounding points restate zoo/layers.py (which tests compare to directly);
hal cannot import zoo, which imports hal.
"""
from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * x32.to(x.dtype)
    return y if residual is None else residual + y


def rotary_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, theta: float,
               interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[T, H, D]`, k `[T, KVH, D]`, positions `[T]`."""
    head_dim = q.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=q.device, dtype=torch.float32) / head_dim)
    angles = positions.float()[:, None] * inv_freq                     # [T, D/2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]            # [T, 1, D/2]

    def half(x: torch.Tensor) -> torch.Tensor:
        c, s = torch.cat([cos, cos], -1).to(x.dtype), torch.cat([sin, sin], -1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat([-x2, x1], dim=-1) * s

    def pairs(x: torch.Tensor) -> torch.Tensor:
        xp = x.float().unflatten(-1, (-1, 2))
        even, odd = xp[..., 0], xp[..., 1]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2).to(x.dtype)

    fn = pairs if interleaved else half
    return fn(q), fn(k)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """In place: rows of `k, v: [T, KVH, D]` to `slot_mapping: [T]` of `kv_cache`; -1 skips."""
    keep = slot_mapping >= 0
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])
    flat[0][slot_mapping[keep]] = k[keep].to(flat.dtype)
    flat[1][slot_mapping[keep]] = v[keep].to(flat.dtype)


def w8a8_slices_ref(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """The W8A8 one-row slice product (hal/kernels/gemv_slice.py `A8`) in float64: one activation scale
    per `block_k` slice of K (`absmax / 448`, as `quantize_rows` per row), each slice's product of FP8
    values exact, times both scales, summed over the slices. a `[M, K]`, e4m3fn weight `[N, K]`, scale `[N]`."""
    total = torch.zeros(a.shape[0], weight.shape[0], dtype=torch.float64, device=a.device)
    for lo in range(0, a.shape[1], block_k):
        part = a[:, lo:lo + block_k].float()
        a_scale = part.abs().amax(1, keepdim=True).clamp_min(1e-12) / 448.0
        aq = (part / a_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        total += (aq.double() @ weight[:, lo:lo + block_k].double().T) * a_scale.double()
    return total * scale.double()
