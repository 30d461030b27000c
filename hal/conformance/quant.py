"""The 8-bit checks (level R2): a quantized KV cache and FP8 linears, for the formats a Hal declares
(`caps.kv_quant_dtypes`, `op("fp8_linear")`); skipped where it declares none.

KV: the Hal's backend and the CPU reference each write the same keys and values into an 8-bit cache
of the same format; what `read_kv` gives back must agree (same quantization rule, hal/common/kv_quant.py)
and attention over the cache must match the reference's within the dtype's tolerance.
FP8 linear: `y = x @ (q * scale).T` within e4m3's rounding of the activations (an implementation may
quantize x per row, W8A8) plus the dtype's, against float64 on the dequantized weight; where offered,
`silu_mul_fp8_linear` the same on `silu(gate) * up` (and with a residual), and `norm_add_norm_fp8`'s
quantized rows exactly what `fp8_linear` makes of norm_add_norm's output.
"""
from __future__ import annotations

import random

import torch

from hal.base import Hal
from hal.conformance.attention_checks import TOLERANCE, _history_batch, _max_err, _random_batch
from hal.conformance.checks import SkipCheck
from hal.common.torch_attention import TorchPagedAttention
from hal.common.kv_quant import quantize


def check_quantized_kv(hal: Hal) -> str:
    """8-bit KV: written values read back as the reference's; attention matches the reference."""
    formats = hal.caps.kv_quant_dtypes
    if not formats:
        raise SkipCheck("the Hal declares no 8-bit KV format (caps.kv_quant_dtypes)")
    device, rng = hal.device(), random.Random(2)
    dtypes = [d for d in (torch.bfloat16, torch.float32) if d in hal.caps.dtypes]
    for kv_dtype in formats:
        for dtype in dtypes:
            heads, kv_heads, head_dim = (16, 8, 128) if dtype == torch.bfloat16 else (6, 3, 40)
            backend = hal.attention(heads, kv_heads, head_dim, dtype, kv_dtype=kv_dtype)
            reference = TorchPagedAttention(heads, kv_heads, head_dim, torch.float32, torch.device("cpu"),
                                            backend.block_size, kv_dtype=kv_dtype)
            batch = _random_batch(rng, backend.block_size, 2, 40)
            total = sum(batch.seq_lens)
            keys, values = (torch.randn(total, kv_heads, head_dim, dtype=dtype) * 3 for _ in range(2))
            q = torch.randn(sum(batch.query_lens), heads, head_dim, dtype=dtype)
            cache = torch.zeros(backend.kv_cache_shape(40), dtype=backend.kv_cache_dtype, device=device)
            ref_cache = torch.zeros(reference.kv_cache_shape(40), dtype=reference.kv_cache_dtype)
            hist, ref_hist = backend.build_meta(_history_batch(batch)), reference.build_meta(_history_batch(batch))
            meta, ref_meta = backend.build_meta(batch), reference.build_meta(batch)
            label = f"{hal.name}/{backend.name} {dtype} over {kv_dtype}"
            for plane in range(2):
                backend.write_kv(keys.to(device), values.to(device), cache, hist, plane)
                reference.write_kv(keys.float(), values.float(), ref_cache, ref_hist, plane)
                out = backend.forward(q.to(device), cache, meta, plane, head_dim ** -0.5)
                ref = reference.forward(q.float(), ref_cache, ref_meta, plane, head_dim ** -0.5)
                assert out.shape == q.shape and out.dtype == dtype, f"{label}: output {out.shape} {out.dtype}"
                err, bound = _max_err(out, ref), TOLERANCE[dtype] * max(1.0, ref.abs().max().item())
                assert err <= bound, f"{label} plane {plane}: max error {err:.2e} > {bound:.2e}"
            slots = torch.tensor([b * backend.block_size for b in batch.block_tables[1][0]], device=device)
            got, want = backend.read_kv(cache, slots)[0], reference.read_kv(ref_cache, slots.cpu())[0]
            assert _max_err(got, want) <= TOLERANCE[dtype] * want.abs().max().item(), f"{label}: read_kv"
    return f"formats {', '.join(str(f).removeprefix('torch.') for f in formats)}"


def check_fp8_linear(hal: Hal) -> str:
    """`op("fp8_linear")` (FP8 weights, per-channel scales): decode and prefill row counts, with a bias."""
    linear, fp8 = hal.op("fp8_linear"), hal.caps.fp8_dtype
    if linear is None or fp8 is None:
        return "no fp8_linear op offered (FP8 weights are dequantized in torch)"
    device = hal.device()
    for dtype in [d for d in (torch.bfloat16, torch.float32) if d in hal.caps.dtypes]:
        for rows in (1, 37):
            x = torch.randn(rows, 256, dtype=dtype) * torch.rand(rows, 1, dtype=dtype) * 4
            weight, scale = quantize(torch.randn(192, 256) * 0.05, fp8)
            bias = torch.randn(192)
            w = weight.double() * scale.double()[:, None]
            ref = x.double() @ w.T + bias.double()
            out = linear(x.to(device), weight.to(device), scale.to(device), bias.to(device))
            assert out.shape == ref.shape and out.dtype == dtype, f"fp8_linear {dtype}: {out.shape} {out.dtype}"
            # W8A8 rounds x to e4m3 (2^-4 of each |x|) on top of the output dtype's rounding
            bound = (x.double().abs() @ w.abs().T) * 2**-4 + TOLERANCE[dtype] * (1 + ref.abs())
            excess = ((out.double().cpu() - ref).abs() - bound).max().item()
            assert excess <= 0, f"fp8_linear {dtype} rows={rows}: error beyond the bound by {excess:.2e}"
    checked = [name for name, check in (("silu_mul_fp8_linear", _check_silu_mul_fp8_linear),
                                        ("norm_add_norm_fp8", _check_norm_add_norm_fp8)) if check(hal, fp8)]
    return ", ".join([f"weights in {str(fp8).removeprefix('torch.')}", *checked])


def _check_norm_add_norm_fp8(hal: Hal, fp8: torch.dtype) -> bool:
    """`op("norm_add_norm_fp8")`: where it hands back quantized rows (a prompt's 40 bf16 rows), h is
    `norm_add_norm`'s and `fp8_linear` of the rows is `fp8_linear` of norm_add_norm's y, both up to the
    last bits of a row statistic summed in another order (the quantizing kernel's own layout: an H100
    compiled Huginn's boundary so), and in the bound of `fp8_linear` with a scale more or less; False where
    the Hal offers none, or declines these rows."""
    fused, boundary, linear = hal.op("norm_add_norm_fp8"), hal.op("norm_add_norm"), hal.op("fp8_linear")
    if fused is None or boundary is None or torch.bfloat16 not in hal.caps.dtypes:
        return False
    device = hal.device()
    x, residual = (torch.randn(40, 256, dtype=torch.bfloat16, device=device) * 3 for _ in range(2))
    post, weight = ((torch.rand(256, device=device) + 0.5).bfloat16() for _ in range(2))
    weight_q, scale = (t.to(device) for t in quantize(torch.randn(192, 256) * 0.05, fp8))
    w = (weight_q.double() * scale.double()[:, None]).abs().cpu()
    hal.synchronize()       # a boundary kernel may read its norm weights before its PDL wait (kernels/pdl.py)
    for post_weight, sum_first in ((post, False), (post, True), (None, False)):
        out = fused(x, residual, post_weight, weight, 1e-6, sum_first=sum_first)
        if out is None:
            return False
        rows, h = out
        y, want_h = boundary(x, residual, post_weight, weight, 1e-6, sum_first=sum_first)
        what = f"norm_add_norm_fp8 post={post_weight is not None} sum_first={sum_first}"
        h_err = ((h.double() - want_h.double()).abs() - 2**-7 * want_h.double().abs()).max().item()
        assert h_err <= 0, f"{what}: h is not norm_add_norm's (beyond 2 bf16 ulps by {h_err:.2e})"
        got, want = linear(rows, weight_q, scale).double().cpu(), linear(y, weight_q, scale).double().cpu()
        # one FP8 step of the activation per value (2^-3 relative) at most, where a last bit of y moved
        bound = (y.double().abs().cpu() @ w.T) * 2**-3 + TOLERANCE[torch.bfloat16] * (1 + want.abs())
        excess = ((got - want).abs() - bound).max().item()
        assert excess <= 0, (f"{what}: fp8_linear of the quantized rows is not fp8_linear of norm_add_norm's y "
                             f"(beyond the bound by {excess:.2e})")
    return True


def _check_silu_mul_fp8_linear(hal: Hal, fp8: torch.dtype) -> bool:
    """`op("silu_mul_fp8_linear")` (x `[M, 2K]` = gate | up) against float64 `silu(gate) * up` times the
    dequantized weight (+ residual), in the bound of `fp8_linear`; False where the Hal offers none."""
    fused = hal.op("silu_mul_fp8_linear")
    if fused is None:
        return False
    device = hal.device()
    for dtype in [d for d in (torch.bfloat16, torch.float32) if d in hal.caps.dtypes]:
        for rows in (1, 37):
            gate_up = torch.randn(rows, 2 * 256, dtype=dtype) * 2
            residual = torch.randn(rows, 192, dtype=dtype)
            weight, scale = quantize(torch.randn(192, 256) * 0.05, fp8)
            w = weight.double() * scale.double()[:, None]
            act = torch.nn.functional.silu(gate_up[:, :256].double()) * gate_up[:, 256:].double()
            for res in (None, residual):
                ref = act @ w.T + (0 if res is None else res.double())
                out = fused(gate_up.to(device), weight.to(device), scale.to(device),
                            None if res is None else res.to(device))
                what = f"silu_mul_fp8_linear {dtype} rows={rows} residual={res is not None}"
                assert out.shape == ref.shape and out.dtype == dtype, f"{what}: {out.shape} {out.dtype}"
                bound = (act.abs() @ w.abs().T) * 2**-4 + TOLERANCE[dtype] * (1 + ref.abs())
                excess = ((out.double().cpu() - ref).abs() - bound).max().item()
                assert excess <= 0, f"{what}: error beyond the bound by {excess:.2e}"
    return True
