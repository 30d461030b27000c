"""Fused small ops under the Triton interpreter against the torch references and zoo/layers.py."""
from __future__ import annotations

import pytest
import torch

from hal.kernels.configs import all_configs, configs_for
from hal.kernels.ops import fused_ops, norm_add_norm, rms_norm, rotary, silu_and_mul
from kernel_reference import rms_norm_ref, rotary_ref, silu_and_mul_ref
from zoo.layers import RMSNorm
from zoo.rope import apply_rope_half, apply_rope_interleaved, rope_tables

pytestmark = pytest.mark.usefixtures("interpreted")

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """fp32: close to rounding; bf16: at most one bf16 ulp apart and nearly all bits equal (the
    kernels round where torch rounds; only fp32 transcendentals and sums may differ)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{what}: {out.dtype}{tuple(out.shape)}"
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-6, atol=2e-6, msg=what)
        return
    ulp = ref.float().abs().clamp_min(1e-30) * 2 ** -7
    assert ((out.float() - ref.float()).abs() <= ulp * 1.01).all(), f"{what}: more than one ulp off"
    equal = (out == ref).float().mean().item()
    assert equal >= 0.98, f"{what}: only {equal:.1%} bitwise equal"


@DTYPES
@pytest.mark.parametrize("hidden", [96, 2048])
def test_rms_norm_matches_zoo(dtype, hidden):
    x = torch.randn(5, 3, hidden).to(dtype) * 3
    layer = RMSNorm(hidden, 1e-6).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(hidden))
        expected = layer(x)
    out = rms_norm(x, layer.weight.detach(), 1e-6)
    _assert_matches(out, expected, f"rms_norm {dtype} {hidden}")
    _assert_matches(out, rms_norm_ref(x, layer.weight.detach(), 1e-6), "rms_norm vs reference")


@DTYPES
def test_rms_norm_with_residual_is_residual_plus_norm(dtype):
    x, residual = torch.randn(7, 200).to(dtype), torch.randn(7, 200).to(dtype)
    weight = torch.randn(200).to(dtype)
    out = rms_norm(x, weight, 1e-5, residual=residual)
    _assert_matches(out, residual + rms_norm_ref(x, weight, 1e-5), f"residual {dtype}")


# the three sublayer boundaries norm_add_norm takes: h = residual + post_norm(x) (Ouro),
# post_norm(x + residual) (sum_first: Huginn), residual + x (no post-norm: pre-norm layers)
BOUNDARIES = pytest.mark.parametrize("boundary", ["sandwich", "sum_first", "pre_norm"])


def _norm_add_norm(boundary, x, residual, post_weight, weight, eps, fn=norm_add_norm):
    post_weight = None if boundary == "pre_norm" else post_weight
    return fn(x, residual, post_weight, weight, eps, sum_first=boundary == "sum_first")


def _unfused(boundary, x, residual, post_weight, weight, eps):
    """`(y, h)` through the launches norm_add_norm replaces: torch's add and the rms_norm kernel."""
    if boundary == "sandwich":
        h = rms_norm(x, post_weight, eps, residual=residual)
    elif boundary == "sum_first":
        h = rms_norm(x + residual, post_weight, eps)
    else:
        h = residual + x
    return rms_norm(h, weight, eps), h


def _reference(boundary, x, residual, post_weight, weight, eps):
    if boundary == "sandwich":
        h = rms_norm_ref(x, post_weight, eps, residual)
    elif boundary == "sum_first":
        h = rms_norm_ref(x + residual, post_weight, eps)
    else:
        h = residual + x
    return rms_norm_ref(h, weight, eps), h


@DTYPES
@BOUNDARIES
@pytest.mark.parametrize("hidden", [96, 200, 2048])
def test_norm_add_norm_matches_zoo_and_the_launches_it_replaces(dtype, boundary, hidden):
    x, residual = torch.randn(5, 3, hidden).to(dtype) * 3, torch.randn(5, 3, hidden).to(dtype)
    post_norm, norm = RMSNorm(hidden, 1e-6).to(dtype), RMSNorm(hidden, 1e-6).to(dtype)
    with torch.no_grad():
        post_norm.weight.copy_(torch.randn(hidden))
        norm.weight.copy_(torch.randn(hidden))
        # the models' torch expressions (zoo/ouro, zoo/huginn, zoo/layers.project's residual add)
        h_zoo = {"sandwich": lambda: post_norm(x, residual=residual),
                 "sum_first": lambda: post_norm(x + residual), "pre_norm": lambda: residual + x}[boundary]()
        y_zoo = norm(h_zoo)
    post_weight, weight = post_norm.weight.detach(), norm.weight.detach()
    y, h = _norm_add_norm(boundary, x, residual, post_weight, weight, 1e-6)
    _assert_matches(h, h_zoo, f"norm_add_norm {boundary} h {dtype} {hidden}")
    _assert_matches(y, y_zoo, f"norm_add_norm {boundary} y {dtype} {hidden}")
    # bit for bit the launches it replaces (what the model takes without it)
    y_unfused, h_unfused = _unfused(boundary, x, residual, post_weight, weight, 1e-6)
    assert torch.equal(h, h_unfused) and torch.equal(y, y_unfused), boundary


@BOUNDARIES
def test_norm_add_norm_promotes_like_torch_and_takes_strided_rows(boundary):
    x = torch.randn(6, 2, 64).to(torch.bfloat16)[:, 0]                 # rows 2 x 64 apart
    residual = torch.randn(6, 64).to(torch.bfloat16)
    post_weight, weight = torch.randn(64), torch.randn(64)              # fp32 weights: y fp32
    y, h = _norm_add_norm(boundary, x, residual, post_weight, weight, 1e-5)
    y_ref, h_ref = _reference(boundary, x, residual, post_weight, weight, 1e-5)
    _assert_matches(h, h_ref, f"{boundary}: bf16 x, fp32 weights: h")
    _assert_matches(y, y_ref, f"{boundary}: bf16 x, fp32 weights: y")
    with pytest.raises(ValueError, match="one shape"):
        _norm_add_norm(boundary, x, residual[:3], post_weight, weight, 1e-5)


def test_norm_add_norm_without_post_norm_ignores_sum_first():
    x, residual, weight = (torch.randn(3, 128).to(torch.bfloat16) for _ in range(3))
    y, h = norm_add_norm(x, residual, None, weight, 1e-6, sum_first=True)
    assert torch.equal(h, residual + x) and torch.equal(y, rms_norm(residual + x, weight, 1e-6))


@BOUNDARIES
def test_norm_add_norm_runs_with_a_table_from_before_its_entry(boundary):
    """A config table without "norm_add_norm" launches the kernel with its "rms_norm" entry."""
    table = {k: v for k, v in configs_for("sm_90").items() if k != "norm_add_norm"}
    x, residual, weight = (torch.randn(3, 128).to(torch.bfloat16) for _ in range(3))
    y, h = _norm_add_norm(boundary, x, residual, weight, weight, 1e-6, fn=fused_ops(table)["norm_add_norm"])
    y_unfused, h_unfused = _unfused(boundary, x, residual, weight, weight, 1e-6)
    assert torch.equal(h, h_unfused) and torch.equal(y, y_unfused)


def test_rms_norm_mixed_dtypes_promote_like_torch():
    x, weight = torch.randn(3, 64).to(torch.bfloat16), torch.randn(64)
    out = rms_norm(x, weight, 1e-6)
    _assert_matches(out, rms_norm_ref(x, weight, 1e-6), "bf16 x, fp32 weight")


@DTYPES
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 24), (8, 2, 80), (8, 1, 128), (13, 13, 24)])
def test_rotary_matches_zoo(dtype, interleaved, heads, kv_heads, head_dim):
    tokens, theta = 6, 10000.0
    positions = torch.randint(0, 4096, (tokens,))
    q = torch.randn(tokens, heads, head_dim).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim).to(dtype)
    q_out, k_out = rotary(q, k, positions, theta, interleaved)
    cos, sin = rope_tables(positions[None], head_dim, theta)
    apply = apply_rope_interleaved if interleaved else apply_rope_half
    _assert_matches(q_out, apply(q[None], cos, sin)[0], f"rotary q {dtype} {interleaved} D{head_dim}")
    _assert_matches(k_out, apply(k[None], cos, sin)[0], f"rotary k {dtype} {interleaved} D{head_dim}")
    ref_q, ref_k = rotary_ref(q, k, positions, theta, interleaved)
    _assert_matches(q_out, ref_q, "rotary vs reference")
    _assert_matches(k_out, ref_k, "rotary vs reference")


def test_rotary_head_groups_cover_every_head():
    """Few tokens spread their heads over several programs, many tokens keep one per token; both
    give the same bits (`ops.rotary_head_groups`)."""
    from hal.kernels.ops import GROUPED_ROTARY_MAX_TOKENS, rotary_head_groups

    for heads, kv_heads in [(55, 55), (16, 16), (20, 4), (8, 1), (6, 2), (3, 1)]:
        q_per, kv_per, groups = rotary_head_groups(1, heads, kv_heads)
        assert q_per * groups >= heads and kv_per * groups >= kv_heads
        assert rotary_head_groups(GROUPED_ROTARY_MAX_TOKENS, heads, kv_heads)[2] == 1
    tokens = GROUPED_ROTARY_MAX_TOKENS + 2
    q, k = torch.randn(tokens, 13, 24), torch.randn(tokens, 13, 24)
    positions = torch.randint(0, 4096, (tokens,))
    whole = rotary(q, k, positions, 1e4, False)
    few = rotary(q[:5], k[:5], positions[:5], 1e4, False)
    assert torch.equal(whole[0][:5], few[0]) and torch.equal(whole[1][:5], few[1])


def test_rotary_takes_strided_views_of_a_fused_projection():
    qkv = torch.randn(5, 8 + 2 * 2, 64)
    q, k = qkv[:, :8], qkv[:, 8:10]
    positions = torch.randint(0, 100, (5,))
    q_out, k_out = rotary(q, k, positions, 500000.0, False)
    ref_q, ref_k = rotary_ref(q, k, positions, 500000.0, False)
    _assert_matches(q_out, ref_q, "strided q")
    _assert_matches(k_out, ref_k, "strided k")


@DTYPES
@pytest.mark.parametrize("intermediate", [40, 1500])
def test_silu_and_mul_matches_reference(dtype, intermediate):
    x = torch.randn(2, 3, 2 * intermediate).to(dtype) * 4
    _assert_matches(silu_and_mul(x), silu_and_mul_ref(x), f"silu {dtype} {intermediate}")


def test_every_small_op_config_a_hal_can_choose():
    """Each distinct small-op config of every arch's table (bf16)."""
    tables = {}
    for table in all_configs().values():
        key = tuple(table[n] for n in ("rms_norm", "norm_add_norm", "rotary", "silu_and_mul"))
        tables.setdefault(key, table)
    x = torch.randn(3, 4096).to(torch.bfloat16)
    q, k = torch.randn(3, 4, 32).to(torch.bfloat16), torch.randn(3, 2, 32).to(torch.bfloat16)
    positions = torch.randint(0, 50, (3,))
    weight = torch.randn(4096).to(torch.bfloat16)
    for table in tables.values():
        ops = fused_ops(table)
        _assert_matches(ops["rms_norm"](x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), "rms_norm")
        for boundary in ("sandwich", "sum_first", "pre_norm"):
            y, h = _norm_add_norm(boundary, x, x, weight, weight, 1e-6, fn=ops["norm_add_norm"])
            y_ref, h_ref = _reference(boundary, x, x, weight, weight, 1e-6)
            _assert_matches(h, h_ref, f"norm_add_norm {boundary} h")
            _assert_matches(y, y_ref, f"norm_add_norm {boundary} y")
        _assert_matches(ops["silu_and_mul"](x), silu_and_mul_ref(x), "silu_and_mul")
        rotated = ops["rotary"](q, k, positions, 1e4, False)
        for got, want in zip(rotated, rotary_ref(q, k, positions, 1e4, False)):
            _assert_matches(got, want, "rotary")


def test_bad_inputs_name_the_fix():
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul(torch.randn(2, 5))
    with pytest.raises(ValueError, match="even head dim"):
        rotary(torch.randn(2, 1, 5), torch.randn(2, 1, 5), torch.arange(2), 1e4, False)
    assert set(fused_ops(configs_for("sm_90"))) == {"rms_norm", "norm_add_norm", "rotary", "silu_and_mul"}
