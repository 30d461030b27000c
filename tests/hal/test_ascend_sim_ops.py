"""The CPU simulation of the torch_npu ops (through the Ascend Hal) equals the CPU reference, and
refuses the calls the NPU would refuse. The `ascend`-marked cases compare the real NPU kernels
with the same reference (`pytest -m ascend` on a 910B)."""
import math
import random

import pytest
import torch

import hal
from hal.ascend.schemas import SchemaError
from hal.ascend.sim.npu import SimNpu
from hal.ascend.sim.attention import NpuOpError
from hal.attention import PagedBatch
from hal.common.torch_attention import TorchPagedAttention
from hal.common.paged import token_positions
from zoo.layers import RMSNorm
from zoo.rope import apply_rope_half, apply_rope_interleaved, rope_tables


def sim_hal(any_shape: bool):
    return hal.get("ascend-sim", sim_any_shape=any_shape)


def ascend_hal(where: str):
    return hal.get("ascend") if where == "npu" else sim_hal(where == "sim-any")


def random_batch(rng: random.Random, num_planes: int, num_blocks: int, bs: int = 128) -> PagedBatch:
    """Prefill, decode and chunked prefill in one batch, shuffled blocks per plane."""
    seq_lens = [rng.randint(2, 2 * bs + 9), rng.randint(1, 3 * bs), rng.randint(bs, 2 * bs)]
    query_lens = [seq_lens[0], 1, rng.randint(2, seq_lens[2])]
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = [[[pool.pop() for _ in range(math.ceil(s / bs))] for s in seq_lens] for _ in range(num_planes)]
    return PagedBatch(query_lens, seq_lens, tables, bs)


def fill_and_attend(backend, batch, keys, values, q, num_blocks, plane_count, scale):
    device = backend.device
    cache = torch.randn(backend.kv_cache_shape(num_blocks), dtype=backend.dtype, device=device)
    history = PagedBatch(list(batch.seq_lens), list(batch.seq_lens), batch.block_tables, batch.block_size)
    hist_meta, meta = backend.build_meta(history), backend.build_meta(batch)
    outs = []
    keys, values, q = (t.to(device, backend.dtype) for t in (keys, values, q))
    for plane in range(plane_count):
        backend.write_kv(keys, values, cache, hist_meta, plane)
        outs.append(backend.forward(q, cache, meta, plane, scale).cpu())
    return outs


@pytest.mark.parametrize("where, dtype, heads, kv_heads, head_dim, tol", [
    ("sim", torch.bfloat16, 8, 2, 128, 3e-2),      # the NPU's own shape limits: D 128, bf16, GQA 4
    ("sim-any", torch.float32, 6, 2, 40, 2e-5),    # lifted limits: any head dim, float32, GQA 3
    ("sim-any", torch.float32, 4, 4, 16, 2e-5),    # MHA
    pytest.param("npu", torch.bfloat16, 8, 2, 128, 3e-2, marks=pytest.mark.ascend),
    pytest.param("npu", torch.bfloat16, 16, 16, 128, 3e-2, marks=pytest.mark.ascend),
])
def test_fused_attention_matches_reference(where, dtype, heads, kv_heads, head_dim, tol):
    backend = ascend_hal(where).attention(heads, kv_heads, head_dim, dtype)
    assert backend.name == "fia"
    batch = random_batch(random.Random(), num_planes=2, num_blocks=24)
    keys = torch.randn(sum(batch.seq_lens), kv_heads, head_dim)
    values = torch.randn(sum(batch.seq_lens), kv_heads, head_dim)
    q = torch.randn(sum(batch.query_lens), heads, head_dim)
    reference = TorchPagedAttention(heads, kv_heads, head_dim, torch.float32, torch.device("cpu"), 128)
    got = fill_and_attend(backend, batch, keys, values, q, 24, 2, 0.11)
    want = fill_and_attend(reference, batch, keys, values, q, 24, 2, 0.11)
    for g, w in zip(got, want):
        assert g.dtype == dtype and g.shape == q.shape
        assert (g.float() - w).abs().max() <= tol


def test_fused_attention_against_naive_softmax():
    """Independent of SDPA: scores, a right-down causal mask and softmax written out in float64."""
    backend = sim_hal(True).attention(6, 2, 8, torch.float64)
    batch = PagedBatch([4, 1, 3], [4, 131, 9], [[[5], [0, 3], [1]]], 128)
    ks, vs = [torch.randn(s, 2, 8, dtype=torch.float64) for s in batch.seq_lens], \
        [torch.randn(s, 2, 8, dtype=torch.float64) for s in batch.seq_lens]
    q = torch.randn(8, 6, 8, dtype=torch.float64)
    (out,) = fill_and_attend(backend, batch, torch.cat(ks), torch.cat(vs), q, 6, 1, 0.3)
    positions, lo = token_positions(batch), 0
    for i, n in enumerate(batch.query_lens):
        k, v = ks[i].repeat_interleave(3, 1), vs[i].repeat_interleave(3, 1)
        for t in range(lo, lo + n):
            p = positions[t]
            weights = (torch.einsum("hd,lhd->hl", q[t], k[:p + 1]) * 0.3).softmax(-1)
            torch.testing.assert_close(out[t], torch.einsum("hl,lhd->hd", weights, v[:p + 1]))
        lo += n


@pytest.mark.parametrize("where", ["sim", pytest.param("npu", marks=pytest.mark.ascend)])
def test_paged_decode_equals_fused_and_skips_unused_planes(where):
    h = ascend_hal(where)
    fia, pa = h.attention(8, 1, 128, torch.bfloat16, backend="fia"), h.attention(8, 1, 128, torch.bfloat16,
                                                                                  backend="fia_pa")
    decode = PagedBatch([1, 1, 1], [9, 300, 129], [[[2], [0, 4, 6], [1, 3]]], 128)
    keys, values = torch.randn(438, 1, 128), torch.randn(438, 1, 128)
    q = torch.randn(3, 8, 128)
    (a,) = fill_and_attend(fia, decode, keys, values, q, 8, 1, 0.09)
    (b,) = fill_and_attend(pa, decode, keys, values, q, 8, 1, 0.09)
    assert pa.ops.counts["paged_decode_attention"] == 1
    assert (a.float() - b.float()).abs().max() <= 2e-2
    # a sequence with no blocks in plane 1: its KV is not written there, its output rows are 0
    device = h.device()
    batch = PagedBatch([2, 1], [2, 5], [[[0], [1]], [[2], []]], 128)
    cache = torch.randn(fia.kv_cache_shape(4), dtype=torch.bfloat16, device=device)
    before = cache.clone()
    meta = fia.build_meta(batch)
    k, v = (torch.randn(3, 1, 128, dtype=torch.bfloat16, device=device) for _ in range(2))
    fia.write_kv(k, v, cache, meta, 1)
    assert torch.equal(cache[:, 0:2], before[:, 0:2]) and not torch.equal(cache[:, 2, :2], before[:, 2, :2])
    out = fia.forward(torch.randn(3, 8, 128, dtype=torch.bfloat16, device=device), cache, meta, 1, 0.1)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and out[:2].abs().sum() > 0


WHERE = ["sim", pytest.param("npu", marks=pytest.mark.ascend)]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
def test_rms_norm_and_silu_match_torch(where, dtype, tol):
    h = ascend_hal(where)
    on = lambda t: t.to(h.device())                                  # noqa: E731
    x, residual = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    norm = RMSNorm(64, 1e-5).to(dtype)
    torch.nn.init.normal_(norm.weight)
    with torch.no_grad():
        got = h.op("rms_norm")(on(x), on(norm.weight), 1e-5).cpu()
        assert (got.float() - norm(x).float()).abs().max() <= tol * 4
        got = h.op("rms_norm")(on(x), on(norm.weight), 1e-5, residual=on(residual)).cpu()
        assert (got.float() - (residual + norm(x)).float()).abs().max() <= tol * 4
        y, summed = h.op("norm_add_norm")(on(x), on(residual), None, on(norm.weight), 1e-5)   # pre-norm
        assert torch.equal(summed.cpu(), x + residual)
        assert (y.cpu().float() - norm(x + residual).float()).abs().max() <= tol * 4
        post_norm = RMSNorm(64, 1e-5).to(dtype)
        torch.nn.init.normal_(post_norm.weight)
        # the three boundaries (zoo's torch expressions) and the NPU kernels each takes
        both = {"rms_norm": 1, "add_rms_norm": 1}
        cases = ((post_norm.weight, False, post_norm(x, residual=residual), both),
                 (post_norm.weight, True, post_norm(x + residual), both),
                 (None, False, residual + x, {"add_rms_norm": 1}))
        for post, sum_first, want, kernels in cases:
            h.ops.counts.clear()
            y, summed = h.op("norm_add_norm")(on(x), on(residual), None if post is None else on(post),
                                              on(norm.weight), 1e-5, sum_first=sum_first)
            what = f"post={post is not None} sum_first={sum_first}"
            assert dict(h.ops.counts) == kernels, (what, h.ops.counts)
            for got, ref in ((summed, want), (y, norm(want))):
                assert (got.cpu().float() - ref.float()).abs().max() <= tol * 4 * (1 + ref.abs().max()), what
            if post is None:
                assert torch.equal(summed.cpu(), residual + x)
    gate_up = torch.randn(3, 7, 2 * 48, dtype=dtype)
    want = torch.nn.functional.silu(gate_up[..., :48].float()) * gate_up[..., 48:].float()
    assert (h.op("silu_and_mul")(on(gate_up)).cpu().float() - want).abs().max() <= tol * 4


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("head_dim, interleaved",
                         [(128, False), (64, False), (96, False), (128, True), (24, True)])
def test_rotary_matches_zoo(where, head_dim, interleaved):
    """Both NPU kernels (apply_rotary_pos_emb for NeoX 64/128, rotary_mul otherwise) against the zoo."""
    h = ascend_hal(where)
    q, k = torch.randn(2, 5, 4, head_dim), torch.randn(2, 5, 2, head_dim)
    positions = torch.randint(0, 4000, (2, 5))
    cos, sin = rope_tables(positions, head_dim, 1e4)
    apply = apply_rope_interleaved if interleaved else apply_rope_half
    want_q, want_k = apply(q, cos, sin), apply(k, cos, sin)
    device = h.device()
    got_q, got_k = h.op("rotary")(q.to(device), k.to(device), positions.to(device), 1e4, interleaved)
    atol = 2e-5 if where == "sim" else 2e-3       # the NPU's own cos/sin of angles up to 4000 rad
    torch.testing.assert_close(got_q.cpu(), want_q, atol=atol, rtol=1e-5)
    torch.testing.assert_close(got_k.cpu(), want_k, atol=atol, rtol=1e-5)
    site = "rotary_qk" if (head_dim in (64, 128) and not interleaved) else "rotary_one"
    assert h.ops.counts[site] >= 1


def _fia_args(T=3, D=128, dtype=torch.bfloat16):
    q = torch.randn(T, 8, D, dtype=dtype)
    cache = torch.randn(4, 128, 2 * D, dtype=dtype)
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    kwargs = dict(atten_mask=mask, block_table=torch.tensor([[0], [1], [2]], dtype=torch.int32),
                  actual_seq_lengths=[1, 2, 3], actual_seq_lengths_kv=[5, 9, 1], num_heads=8,
                  num_key_value_heads=2, scale=0.1, input_layout="TND", sparse_mode=3, block_size=128)
    return (q, cache, cache), kwargs


@pytest.mark.parametrize("change, error, match", [
    (dict(num_head=8), SchemaError, "no argument named 'num_head'"),
    (dict(input_layout="BNSD"), NotImplementedError, "TND"),
    (dict(actual_seq_lengths=[1, 2, 2]), NpuOpError, "ending at T=3"),
    (dict(actual_seq_lengths=[2, 1, 3]), NpuOpError, "non-decreasing"),
    (dict(atten_mask=torch.ones(2048, 2048, dtype=torch.bool).tril()), NpuOpError, "compressed causal mask"),
    (dict(block_table=torch.tensor([[0], [1], [2]])), NpuOpError, "int32"),
    (dict(actual_seq_lengths_kv=[5, 9]), NpuOpError, "per sequence"),
    (dict(actual_seq_lengths_kv=[5, 9, 200]), NpuOpError, "narrower"),
    (dict(num_heads=4), NpuOpError, "num_heads=4"),
    (dict(block_size=64), NpuOpError, "block_size"),
    (dict(pse_shift=torch.zeros(1)), NotImplementedError, "pse_shift"),
])
def test_fused_attention_refuses_bad_calls(change, error, match):
    args, kwargs = _fia_args()
    with pytest.raises(error, match=match):
        SimNpu().npu_fused_infer_attention_score(*args, **{**kwargs, **change})


def test_hardware_limits_and_other_refusals():
    args, kwargs = _fia_args(D=64)
    with pytest.raises(NpuOpError, match="D = 128"):
        SimNpu(strict=True).npu_fused_infer_attention_score(*args, **kwargs)
    SimNpu(strict=False).npu_fused_infer_attention_score(*args, **kwargs)
    args, kwargs = _fia_args(dtype=torch.float32)
    with pytest.raises(NpuOpError, match="float16 or bfloat16"):
        SimNpu().npu_fused_infer_attention_score(*args, **kwargs)
    with pytest.raises(SchemaError, match="positional"):          # keyword-only passed by position
        SimNpu().npu_fused_infer_attention_score(*args, kwargs["atten_mask"])
    key, cache = torch.randn(2, 2, 16), torch.zeros(2, 128, 2, 16)
    scatter = SimNpu().npu_scatter_pa_kv_cache
    with pytest.raises(NpuOpError, match="slots must lie in"):     # the kernel takes no -1 slots
        scatter(key, key, cache, cache.clone(), torch.tensor([3, -1]), cache_mode="Norm")
    with pytest.raises(NpuOpError, match="repeat"):
        scatter(key, key, cache, cache.clone(), torch.tensor([3, 3]), cache_mode="Norm")
    with pytest.raises(NotImplementedError, match="Norm"):
        scatter(key, key, cache, cache.clone(), torch.tensor([3, 4]))               # the PA_NZ default
    with pytest.raises(NpuOpError, match="host int32"):
        q = torch.randn(1, 4, 16, dtype=torch.bfloat16)
        SimNpu()._npu_paged_attention(query=q, key_cache=cache.bfloat16(), value_cache=cache.bfloat16(),
                                      num_kv_heads=2, num_heads=4, scale_value=1.0,
                                      block_table=torch.zeros(1, 1, dtype=torch.int32),
                                      context_lens=torch.tensor([3]), out=torch.empty_like(q))
    with pytest.raises(NpuOpError, match="gamma dtype"):
        SimNpu().npu_rms_norm(torch.randn(2, 8), torch.randn(8, dtype=torch.bfloat16))
    with pytest.raises(NpuOpError, match="'half' only"):
        x, c = torch.randn(1, 2, 4, 128), torch.randn(1, 2, 1, 128)
        SimNpu().npu_apply_rotary_pos_emb(x, x.clone(), c, c, rotary_mode="interleave")
