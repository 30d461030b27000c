"""Rotary + KV write in one kernel (hal/kernels/rotary_kv.py) and prefill without context on the
fresh K/V (hal/kernels/fresh.py, `TritonPagedAttention.attend`), under the Triton interpreter."""
from __future__ import annotations

import pytest
import torch

from hal.attention import PagedBatch
from hal.kernels import fresh
from hal.kernels.backend import TritonPagedAttention
from hal.kernels.configs import KernelConfig, configs_for
from hal.kernels.kv_write import write_kv
from hal.kernels.ops import rotary
from hal.kernels.rotary_kv import rotary_kv_write

pytestmark = pytest.mark.usefixtures("interpreted")

CPU = torch.device("cpu")
ROTARY = KernelConfig(1, 1, 4, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (6, 2, 40), (13, 13, 24)])
def test_rotary_kv_write_is_rotary_then_write_kv_bit_for_bit(dtype, interleaved, heads, kv_heads, head_dim):
    tokens, page = 5, 4
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim).to(dtype)        # views of one projection
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    positions = torch.randint(0, 3000, (tokens,))
    slots = torch.tensor([9, -1, 0, 14, 3])                                      # -1: no write
    fused_cache = torch.full((2, 4, page, kv_heads, head_dim), float("nan")).to(dtype)
    plain_cache = fused_cache.clone()
    q_fused = rotary_kv_write(q, k, v, positions, 1e4, interleaved, fused_cache, slots, ROTARY)
    q_plain, k_plain = rotary(q, k, positions, 1e4, interleaved)
    write_kv(k_plain, v, plain_cache, slots, KernelConfig(1, 1, 4, 1))
    assert torch.equal(q_fused, q_plain)
    assert torch.equal(fused_cache.nan_to_num(7.0), plain_cache.nan_to_num(7.0))
    kept_cache = torch.full_like(fused_cache, float("nan"))
    q_kept, k_kept, v_kept = rotary_kv_write(q, k, v, positions, 1e4, interleaved, kept_cache, slots, ROTARY,
                                             keep_kv=True, copy_v=True)
    assert torch.equal(q_kept, q_plain) and torch.equal(k_kept, k_plain)         # every token, slot -1 too
    assert torch.equal(v_kept, v) and v_kept.is_contiguous() and v_kept.data_ptr() != v.data_ptr()
    assert torch.equal(kept_cache.nan_to_num(7.0), plain_cache.nan_to_num(7.0))
    viewed_cache = torch.full_like(fused_cache, float("nan"))                   # by default v itself comes back
    q_viewed, k_viewed, v_viewed = rotary_kv_write(q, k, v, positions, 1e4, interleaved, viewed_cache, slots, ROTARY,
                                                   keep_kv=True)
    assert torch.equal(q_viewed, q_plain) and torch.equal(k_viewed, k_plain) and v_viewed is v
    assert torch.equal(viewed_cache.nan_to_num(7.0), plain_cache.nan_to_num(7.0))


def _backend(mode, dtype=torch.bfloat16, heads=4, kv_heads=2, head_dim=32, **kw):
    kw.setdefault("fresh_min_tokens", 0)          # tiny prompts take the fresh path (past decode-like ones)
    return TritonPagedAttention(heads, kv_heads, head_dim, dtype, CPU, 4, configs=configs_for("default"),
                                num_compute_units=4, fresh_attention=mode, **kw)


def _batch(query_lens, seq_lens, page=4):
    tables, nxt = [], 0
    for s in seq_lens:
        n = -(-s // page)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    return PagedBatch(query_lens, seq_lens, [tables], page), nxt


def test_only_batches_of_fresh_prefills_take_the_fresh_path():
    backend = _backend("sdpa")
    assert backend.build_meta(_batch([12, 9], [12, 9])[0]).fresh_lens == (12, 9)
    assert backend.build_meta(_batch([12, 1], [12, 30])[0]).fresh_lens is None          # a decode row
    assert backend.build_meta(_batch([12], [20])[0]).fresh_lens is None                 # a later chunk
    assert backend.build_meta(_batch([1, 1], [1, 1])[0]).fresh_lens is None             # decode-like
    assert _backend(None).build_meta(_batch([12], [12])[0]).fresh_lens is None
    assert _backend("flash", dtype=torch.float32).fresh_attention is None                # golden runs
    assert _backend("sdpa", kv_dtype=torch.float8_e4m3fn).fresh_attention == "sdpa"      # over FP8 too
    many = [9] * (fresh.MAX_SDPA_SEQS + 1)
    assert _backend("sdpa").build_meta(_batch(many, many)[0]).fresh_lens is None
    assert _backend("flash").build_meta(_batch(many, many)[0]).fresh_lens == tuple(many)


def test_prompts_shorter_than_the_backends_length_attend_over_their_own_kv():
    """Below `fresh_min_tokens` (by default `fresh.MIN_TOKENS`) a batch of prompts attends over its own
    K/V on the paged kernel; the longest prompt decides; the backend reports the length in its caps
    (the runtime's captured passes draw the same line)."""
    default = TritonPagedAttention(4, 2, 32, torch.bfloat16, CPU, 4, fresh_attention="flash")
    assert default.caps.fresh_min_tokens == fresh.MIN_TOKENS and _backend(None).caps.fresh_min_tokens is None
    backend = _backend("flash", fresh_min_tokens=13)
    assert backend.caps.fresh_min_tokens == 13
    short = backend.build_meta(_batch([12, 9], [12, 9])[0])
    assert short.fresh_lens is None and short.own_kv
    assert backend.build_meta(_batch([13, 9], [13, 9])[0]).fresh_lens == (13, 9)
    assert _backend("flash").fresh_min_tokens == 9                         # never a decode-like batch


def test_fresh_check_takes_numpy_lengths():
    """Padded batches (runtime/execution/step_inputs.py `pad`) carry numpy lengths; a batch of more
    than one row once raised "truth value of an array is ambiguous" here (speculation rounds on the H200)."""
    import numpy as np

    assert not fresh.takes("sdpa", np.ones(8, dtype=np.int64), np.arange(8, 16), 1, 4, 4)
    assert fresh.takes("sdpa", np.array([12, 9]), np.array([12, 9]), 1, 4, 4)
    assert not fresh.takes("sdpa", np.array([], dtype=np.int64), np.array([], dtype=np.int64), 1, 4, 4)


@pytest.mark.parametrize("mode", ["sdpa", "flash"])
def test_fresh_path_writes_the_cache_and_matches_the_paged_kernel(mode, monkeypatch):
    calls = []

    def flash_on_cpu(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, scale):
        # the varlen entry point is CUDA-only: check the call, answer with per-sequence SDPA
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k, dropout, causal, debug))
        lens = (cu_q[1:] - cu_q[:-1]).tolist()
        return (fresh.attention("sdpa", q, k, v, cu_q, lens, scale),)

    monkeypatch.setattr(fresh, "_flash_varlen", flash_on_cpu)
    lens = [13, 6, 20]
    batch, num_blocks = _batch(lens, lens)
    backend, paged = _backend(mode), _backend(None)
    q = torch.randn(sum(lens), 4, 32).bfloat16()
    k, v = torch.randn(sum(lens), 2, 32).bfloat16(), torch.randn(sum(lens), 2, 32).bfloat16()
    caches = [torch.zeros(b.kv_cache_shape(num_blocks), dtype=torch.bfloat16) for b in (backend, paged)]
    out = backend.attend(q, k, v, caches[0], backend.build_meta(batch), 0, 0.2)
    ref = paged.attend(q, k, v, caches[1], paged.build_meta(batch), 0, 0.2)
    assert torch.equal(caches[0], caches[1])
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
    if mode == "flash":
        assert calls == [([0, 13, 19, 39], [0, 13, 19, 39], 20, 20, 0.0, True, False)]


@pytest.mark.parametrize("cudnn_refuses", [True, False])
def test_cudnn_mode_takes_one_long_prompt_and_falls_back_to_flash(cudnn_refuses, monkeypatch):
    flash_calls, cudnn_calls = [], []

    def flash_on_cpu(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, scale):
        flash_calls.append(cu_q.tolist())
        return (fresh.attention("sdpa", q, k, v, cu_q, (cu_q[1:] - cu_q[:-1]).tolist(), scale),)

    def cudnn_on_cpu(q, k, v, scale):
        cudnn_calls.append(q.shape[0])
        if cudnn_refuses:
            fresh._cudnn_refused.append("no cuDNN here")
            return None
        return fresh.attention("sdpa", q, k, v, None, [q.shape[0]], scale)

    monkeypatch.setattr(fresh, "_flash_varlen", flash_on_cpu)
    monkeypatch.setattr(fresh, "_cudnn", cudnn_on_cpu)
    monkeypatch.setattr(fresh, "_cudnn_refused", [])
    monkeypatch.setattr(fresh, "CUDNN_MIN_TOKENS", 16)
    q = torch.randn(40, 2, 32).bfloat16()
    k, v = torch.randn(40, 2, 32).bfloat16(), torch.randn(40, 2, 32).bfloat16()
    ref = fresh.attention("sdpa", q, k, v, None, [20, 20], 0.2)
    two = fresh.attention("cudnn", q, k, v, torch.tensor([0, 20, 40]), [20, 20], 0.2)   # two prompts: flash
    assert torch.equal(two, ref) and flash_calls == [[0, 20, 40]] and cudnn_calls == []
    one = fresh.attention("cudnn", q[:20], k[:20], v[:20], torch.tensor([0, 20]), [20], 0.2)
    assert torch.equal(one, ref[:20]) and cudnn_calls == [20]
    fresh.attention("cudnn", q[:20], k[:20], v[:20], torch.tensor([0, 20]), [20], 0.2)
    # refused once: never asked again, flash serves
    assert cudnn_calls == ([20] if cudnn_refuses else [20, 20])
    assert len(flash_calls) == (3 if cudnn_refuses else 1)


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (13, 13, 24), (6, 2, 40)])
def test_quantizing_rotary_kv_write_is_rotary_then_write_kv_bit_for_bit(interleaved, heads, kv_heads, head_dim):
    """Over an 8-bit cache the one launch rotates, rounds to k's dtype and quantizes: the same bytes
    and scales as the rotary op followed by the quantizing `write_kv` (slot -1 writes nothing)."""
    backend = _backend(None, heads=heads, kv_heads=kv_heads, head_dim=head_dim, kv_dtype=torch.float8_e4m3fn)
    tokens = 5
    qkv = (3 * torch.randn(tokens, heads + 2 * kv_heads, head_dim)).bfloat16()
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    k[1] = 0.0                                                                   # an all-zero key: scale 1
    positions = torch.randint(0, 3000, (tokens,))
    slots = torch.tensor([9, -1, 0, 14, 3])
    fused_cache = torch.zeros(backend.kv_cache_shape(4), dtype=backend.kv_cache_dtype)
    plain_cache = fused_cache.clone()
    values, scales = backend._views(fused_cache)
    q_fused = rotary_kv_write(q, k, v, positions, 1e4, interleaved, values, slots, ROTARY, kv_scales=scales)
    q_plain, k_plain = rotary(q, k, positions, 1e4, interleaved)
    values, scales = backend._views(plain_cache)
    write_kv(k_plain, v, values, slots, KernelConfig(1, 1, 4, 1), scales)
    assert torch.equal(q_fused, q_plain)
    assert torch.equal(fused_cache.view(torch.uint8), plain_cache.view(torch.uint8))
    assert fused_cache.view(torch.uint8).any()
    # with keep_kv the same launch hands back K and V as the cache holds them, as the quantizing
    # write_kv's `dequantize` does (zeros for the slot -1 token)
    kept_cache = torch.zeros_like(fused_cache)
    values, scales = backend._views(kept_cache)
    q_kept, k_held, v_held = rotary_kv_write(q, k, v, positions, 1e4, interleaved, values, slots, ROTARY, keep_kv=True,
                                             kv_scales=scales)
    values, scales = backend._views(torch.zeros_like(fused_cache))
    k_ref, v_ref = write_kv(k_plain, v, values, slots, KernelConfig(1, 1, 4, 1), scales, dequantize=True)
    assert torch.equal(q_kept, q_plain) and torch.equal(kept_cache.view(torch.uint8), plain_cache.view(torch.uint8))
    assert torch.equal(k_held, k_ref) and torch.equal(v_held, v_ref)
    assert k_held[0].abs().sum() > 0 and not k_held[1].any()


def test_attend_rotary_over_an_8bit_cache():
    """Decode-like batches take the quantizing launch and the paged kernel; a prefill without context
    the quantizing launch that hands back the dequantized K/V, then the fresh path over them: the
    same outputs and cache bytes as rotary then `attend` in both cases."""
    backend = _backend("sdpa", kv_dtype=torch.float8_e4m3fn)
    q, k, v = torch.randn(3, 4, 32).bfloat16(), torch.randn(3, 2, 32).bfloat16(), torch.randn(3, 2, 32).bfloat16()
    cache = torch.zeros(backend.kv_cache_shape(6), dtype=backend.kv_cache_dtype)     # _batch's 5 blocks fit
    fresh_meta = backend.build_meta(_batch([12], [12])[0])
    assert fresh_meta.fresh_lens == (12,)
    q12, k12, v12 = (torch.randn(12, n, 32).bfloat16() for n in (4, 2, 2))
    fused_cache, plain_cache = cache.clone(), cache.clone()
    positions = torch.arange(12) + 3
    fused = backend.attend_rotary(q12, k12, v12, fused_cache, fresh_meta, 0, positions, 1e4, False, 0.2)
    q_rot, k_rot = rotary(q12, k12, positions, 1e4, False)
    plain = backend.attend(q_rot, k_rot, v12, plain_cache, fresh_meta, 0, 0.2)
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache.view(torch.uint8), plain_cache.view(torch.uint8))
    decode = _batch([1, 1, 1], [5, 2, 7])[0]
    meta = backend.build_meta(decode)
    assert meta.fresh_lens is None
    positions = torch.tensor([4, 1, 6])
    fused_cache, plain_cache = cache.clone(), cache.clone()
    fused = backend.attend_rotary(q, k, v, fused_cache, meta, 0, positions, 1e4, False, 0.2)
    q_rot, k_rot = rotary(q, k, positions, 1e4, False)
    plain = backend.attend(q_rot, k_rot, v, plain_cache, meta, 0, 0.2)
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache.view(torch.uint8), plain_cache.view(torch.uint8))


@pytest.mark.parametrize("mode", [None, "sdpa"], ids=["paged", "fresh"])
def test_attend_rotary_is_rotary_then_attend_bit_for_bit(mode, monkeypatch):
    """One launch rotates q and k and writes the cache; the paged kernel, or for a prefill without
    context the fresh path over the rotated k the launch hands back: the same output and cache as
    the rotary op followed by `attend`, and the fresh path keeps its single rotary launch."""
    backend = _backend(mode)
    meta = backend.build_meta(_batch([12], [12])[0])
    assert (meta.fresh_lens is not None) == (mode is not None)
    q, k, v = torch.randn(12, 4, 32).bfloat16(), torch.randn(12, 2, 32).bfloat16(), torch.randn(12, 2, 32).bfloat16()
    positions = torch.arange(12)
    fused_cache = torch.zeros(backend.kv_cache_shape(3), dtype=torch.bfloat16)
    plain_cache = fused_cache.clone()
    import hal.kernels.ops as ops_module

    rotary_calls = []
    real_rotary = ops_module.rotary
    monkeypatch.setattr(ops_module, "rotary", lambda *a, **kw: rotary_calls.append(1) or real_rotary(*a, **kw))
    fused = backend.attend_rotary(q, k, v, fused_cache, meta, 0, positions, 1e4, False, 0.2)
    assert rotary_calls == []
    q_rot, k_rot = real_rotary(q, k, positions, 1e4, False)
    plain = backend.attend(q_rot, k_rot, v, plain_cache, meta, 0, 0.2)
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache, plain_cache)


def test_fresh_path_over_an_fp8_cache_attends_over_what_the_cache_holds():
    """The chunk's K/V go through the quantizing write, and the fresh attention sees them as the cache
    holds them (quantized, widened back): the paged kernel reading the cache gives the same result
    within the 16-bit rounding of value x scale."""
    from hal.common.kv_quant import fake_quantize

    lens = [13, 6]
    batch, num_blocks = _batch(lens, lens)
    fp8 = {"kv_dtype": torch.float8_e4m3fn}
    backend, paged = _backend("sdpa", **fp8), _backend(None, **fp8)
    q = torch.randn(sum(lens), 4, 32).bfloat16()
    k, v = torch.randn(sum(lens), 2, 32).bfloat16(), torch.randn(sum(lens), 2, 32).bfloat16()
    caches = [torch.zeros(b.kv_cache_shape(num_blocks), dtype=b.kv_cache_dtype) for b in (backend, paged)]
    out = backend.attend(q, k, v, caches[0], backend.build_meta(batch), 0, 0.2)
    ref = paged.attend(q, k, v, caches[1], paged.build_meta(batch), 0, 0.2)
    exact = fresh.attention("sdpa", q, k, v, batch_starts(lens), lens, 0.2)
    assert torch.equal(caches[0], caches[1])
    assert (out.float() - ref.float()).abs().max().item() < 2e-2
    quantized = fresh.attention("sdpa", q, fake_quantize(k, torch.float8_e4m3fn),
                                fake_quantize(v, torch.float8_e4m3fn), batch_starts(lens), lens, 0.2)
    assert torch.equal(out, quantized) and not torch.equal(out, exact)


def batch_starts(lens):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)


def test_cudnn_batches_get_v_as_the_projections_view(monkeypatch):
    """Where cuDNN attends (one long prompt, as many KV heads as query heads), v reaches it as the
    view of the q|k|v projection: cuDNN attends as fast over it as over a copy, which costs a write
    (docs/performance.md lever 101, measured on an H100). Outputs equal SDPA's over the same inputs."""
    seen = []

    def fake_cudnn(q, k, v, scale):        # the CPU has no cuDNN: record what it would get, attend by SDPA
        seen.append(v.is_contiguous())
        return fresh.attention("sdpa", q, k, v, torch.tensor([0, q.shape[0]]), [q.shape[0]], scale)

    monkeypatch.setattr(fresh, "_cudnn", fake_cudnn)
    monkeypatch.setattr(fresh, "CUDNN_MIN_TOKENS", 8)
    monkeypatch.setattr(fresh, "_cudnn_refused", [])             # whatever an earlier test left there
    assert fresh.takes_cudnn("cudnn", [12], 4, 4) and not fresh.takes_cudnn("cudnn", [12], 4, 2)
    assert not fresh.takes_cudnn("cudnn", [12, 9], 4, 4) and not fresh.takes_cudnn("cudnn", [7], 4, 4)
    assert not fresh.takes_cudnn("flash", [12], 4, 4)
    monkeypatch.setattr(fresh, "_cudnn_refused", ["refused once"])    # then every call runs flash: no copy
    assert not fresh.takes_cudnn("cudnn", [12], 4, 4)
    monkeypatch.setattr(fresh, "_cudnn_refused", [])
    backend = _backend("cudnn", heads=4, kv_heads=4)
    meta = backend.build_meta(_batch([12], [12])[0])
    qkv = torch.randn(12, 12, 32).bfloat16()                                    # views of one projection
    q, k, v = qkv[:, :4], qkv[:, 4:8], qkv[:, 8:]
    positions = torch.arange(12)
    cache = torch.zeros(backend.kv_cache_shape(4), dtype=backend.kv_cache_dtype)
    out = backend.attend_rotary(q, k, v, cache, meta, 0, positions, 1e4, False, 0.2)
    assert seen == [False]
    q_rot, k_rot = rotary(q, k, positions, 1e4, False)
    ref = fresh.attention("sdpa", q_rot, k_rot, v, meta.query_start_loc, [12], 0.2)
    assert torch.equal(out, ref)


def test_cudnn_mode_takes_cudnn_batches_only():
    """On Hopper ("cudnn") the fresh path takes one prompt of as many KV heads as heads; a grouped-query
    prompt or several prompts attend over their own K/V on the paged kernel (faster than flash, lever 138),
    and a grouped-query backend reports no fresh path to the runtime's captured prefills."""
    mha, gqa = _backend("cudnn", heads=4, kv_heads=4), _backend("cudnn", heads=4, kv_heads=2)
    assert mha.build_meta(_batch([12], [12])[0]).fresh_lens == (12,)
    for backend, lens in ((gqa, [12]), (mha, [9, 9])):
        meta = backend.build_meta(_batch(lens, lens)[0])
        assert meta.fresh_lens is None and meta.own_kv
    assert mha.caps.fresh_min_tokens == 9 and gqa.caps.fresh_min_tokens is None
    assert _backend("flash", heads=4, kv_heads=2).build_meta(_batch([9, 9], [9, 9])[0]).fresh_lens == (9, 9)


@pytest.mark.parametrize("mode,heads,kv_heads,lens", [("cudnn", 4, 4, [12]), ("flash", 4, 2, [12]),
                                                      ("flash", 4, 4, [9, 9])],
                         ids=["cudnn", "gqa", "two-prompts"])
def test_no_fresh_batch_pays_a_v_copy(monkeypatch, mode, heads, kv_heads, lens):
    """The fresh path gets v as the projection's view whichever kernel takes the batch."""
    seen = []

    def spy(mode, q, k, v, starts, query_lens, scale):
        seen.append(v.is_contiguous())
        return torch.zeros_like(q)

    monkeypatch.setattr(fresh, "attention", spy)
    monkeypatch.setattr(fresh, "CUDNN_MIN_TOKENS", 6)
    monkeypatch.setattr(fresh, "_cudnn_refused", [])
    backend = _backend(mode, heads=heads, kv_heads=kv_heads)
    meta = backend.build_meta(_batch(lens, lens)[0])
    assert meta.fresh_lens == tuple(lens)
    qkv = torch.randn(sum(lens), heads + 2 * kv_heads, 32).bfloat16()
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    cache = torch.zeros(backend.kv_cache_shape(8), dtype=backend.kv_cache_dtype)
    backend.attend_rotary(q, k, v, cache, meta, 0, torch.arange(sum(lens)), 1e4, False, 0.2)
    assert seen == [False]


def _own_kv_case(lens, kv_heads=2, seed=0):
    torch.manual_seed(seed)
    backend = _backend(None, kv_heads=kv_heads, kv_dtype=torch.float8_e4m3fn)
    batch, num_blocks = _batch(lens, lens)
    q = torch.randn(sum(lens), 4, 32).bfloat16()
    k = (3 * torch.randn(sum(lens), kv_heads, 32)).bfloat16()
    v = torch.randn(sum(lens), kv_heads, 32).bfloat16()
    return backend, batch, num_blocks, q, k, v


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_prompts_over_an_fp8_cache_attend_over_their_own_dequantized_kv(kv_heads):
    """Prompts without context over an 8-bit cache (lever 135): the write hands back K and V as the
    cache holds them, and the paged kernel's 16-bit tile attends over those rows (pages of one token)
    instead of widening FP8 tiles of the cache: bit for bit the 16-bit kernel over a 16-bit cache
    holding the same values, within FP8 kernel's rounding of it, and the cache bytes are the write's."""
    from hal.kernels.attend import paged_attention

    lens = [37, 9, 20]
    backend, batch, num_blocks, q, k, v = _own_kv_case(lens, kv_heads)
    meta = backend.build_meta(batch)
    assert meta.own_kv and meta.fresh_lens is None
    cache = torch.zeros(backend.kv_cache_shape(num_blocks), dtype=backend.kv_cache_dtype)
    out = backend.attend(q, k, v, cache, meta, 0, 0.2)
    plain_cache = torch.zeros_like(cache)
    values, scales = backend._views(plain_cache)
    k_held, v_held = write_kv(k, v, values, meta.slot_mapping[0], backend.configs["kv_write"], scales,
                              dequantize=True)
    assert torch.equal(cache.view(torch.uint8), plain_cache.view(torch.uint8))
    bf16 = _backend(None, kv_heads=kv_heads)
    bf16_cache = torch.zeros(bf16.kv_cache_shape(num_blocks), dtype=torch.bfloat16)
    bf16_meta = bf16.build_meta(batch)
    bf16.write_kv(k_held, v_held, bf16_cache, bf16_meta, 0)
    assert torch.equal(out, bf16.forward(q, bf16_cache, bf16_meta, 0, 0.2))
    fp8_kernel = backend.forward(q, cache, meta, 0, 0.2)           # the cache read back, FP8 tiles widened
    assert (out.float() - fp8_kernel.float()).abs().max().item() < 2e-2
    with pytest.raises(ValueError, match="own_kv serves prompts"):
        paged_attention(q, values, meta.block_tables[0], meta.seq_lens, meta.query_start_loc, 8, 0.2,
                        backend.configs, 4, own_kv=(k_held, v_held))


def test_attend_rotary_over_own_kv_is_rotary_then_attend():
    """The fused rotary + quantizing write hands back the dequantized K/V for the own-K/V attention:
    the same output and cache bytes as the rotary op followed by `attend`."""
    lens = [24]
    backend, batch, num_blocks, q, k, v = _own_kv_case(lens)
    meta = backend.build_meta(batch)
    fused_cache = torch.zeros(backend.kv_cache_shape(num_blocks), dtype=backend.kv_cache_dtype)
    plain_cache = fused_cache.clone()
    positions = torch.arange(24)
    fused = backend.attend_rotary(q, k, v, fused_cache, meta, 0, positions, 1e4, False, 0.2)
    q_rot, k_rot = rotary(q, k, positions, 1e4, False)
    plain = backend.attend(q_rot, k_rot, v, plain_cache, meta, 0, 0.2)
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache.view(torch.uint8), plain_cache.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_prompts_over_a_16bit_cache_attend_over_their_own_kv_bit_for_bit(dtype):
    """Lever 136: over a 16-bit (or float32) cache the own K/V are the values the cache holds (k rotated
    and a copy of v from the fused rotary write, or k and v themselves), so the output is the paged
    kernel's reading the cache, bit for bit, and so are the cache's bytes."""
    lens = [37, 9, 20]
    backend = _backend(None, dtype=dtype)
    batch, num_blocks = _batch(lens, lens)
    meta = backend.build_meta(batch)
    assert meta.own_kv
    qkv = torch.randn(sum(lens), 8, 32).to(dtype)                               # views of one projection
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    caches = [torch.zeros(backend.kv_cache_shape(num_blocks), dtype=dtype) for _ in range(4)]
    out = backend.attend(q, k, v, caches[0], meta, 0, 0.2)
    backend.write_kv(k, v, caches[1], meta, 0)
    assert torch.equal(out, backend.forward(q, caches[1], meta, 0, 0.2)) and torch.equal(caches[0], caches[1])
    positions = torch.arange(sum(lens))
    fused = backend.attend_rotary(q, k, v, caches[2], meta, 0, positions, 1e4, False, 0.2)
    q_rot, k_rot = rotary(q, k, positions, 1e4, False)
    backend.write_kv(k_rot, v, caches[3], meta, 0)
    assert torch.equal(fused, backend.forward(q_rot, caches[3], meta, 0, 0.2))
    assert torch.equal(caches[2], caches[3])


def test_which_fp8_batches_attend_over_their_own_kv():
    """Only prefills without context, outside the fresh path, in the prefill config; a captured pass
    where its capacity says it has no context (its padding rows may start inside a scratch block)."""
    from hal.attention import MetaCapacity

    fp8 = {"kv_dtype": torch.float8_e4m3fn}
    backend = _backend(None, **fp8)
    assert backend.build_meta(_batch([12, 9], [12, 9])[0]).own_kv
    assert not backend.build_meta(_batch([12], [20])[0]).own_kv                      # a later chunk
    assert not backend.build_meta(_batch([12, 1], [12, 30])[0]).own_kv               # mixed
    assert not backend.build_meta(_batch([5, 3], [5, 3])[0]).own_kv                  # decode-like
    assert not _backend("sdpa", **fp8).build_meta(_batch([12], [12])[0]).own_kv      # the fresh path's
    assert _backend(None).build_meta(_batch([12], [12])[0]).own_kv                   # a 16-bit cache too
    padded, _ = _batch([16, 16], [16, 18])                                           # a padding row's context
    for context, expected in ((False, True), (True, False)):
        capacity = MetaCapacity(2, 32, 8, 1, 64, context=context)
        assert backend.build_meta(padded, capacity).own_kv == expected
    packed = MetaCapacity(2, 32, 8, 1, 64, context=False, packed=True)
    assert not backend.build_meta(padded, packed).own_kv
