"""The TMA grouped-query FP8 decode kernel (hal/kernels/gqa_decode.py) under the Triton interpreter
against the float32 reference reading the same FP8 cache: one and two pages per step, context
splits, both grid orders, scales over wide ranges (the lazy references), graph padding, and the
routing that sends it only single-token grouped-query batches over an FP8 cache."""
from __future__ import annotations

import random

import pytest
import torch
from paged_cases import random_case, run_both
from test_interp_row_decode import _run_fp8

from hal.kernels import attend, gqa_decode
from hal.kernels.backend import TritonPagedAttention
from hal.kernels.configs import KernelConfig, configs_for

pytestmark = pytest.mark.usefixtures("interpreted")

CPU = torch.device("cpu")
FP8_KEY = attend.GQA_TMA_KEY + "_fp8"


def _backend(heads, kv_heads, head_dim, config, num_compute_units=64, dtype=torch.bfloat16,
             kv_dtype=torch.float8_e4m3fn):
    configs = {**configs_for("default"), FP8_KEY if kv_dtype else attend.GQA_TMA_KEY: config}
    return TritonPagedAttention(heads, kv_heads, head_dim, dtype, CPU, 16, configs=configs,
                                num_compute_units=num_compute_units, kv_dtype=kv_dtype)


def _count_launches(monkeypatch) -> list[int]:
    calls = []
    real = attend.gqa_decode_launches

    def counting(*args, **kwargs):
        launches = real(*args, **kwargs)
        calls.append(launches[0].grid[2])          # context splits
        return launches

    monkeypatch.setattr(attend, "gqa_decode_launches", counting)
    return calls


TABLE_CONFIG = (KernelConfig(16, 32, 1, 3, split_k=0), 128)           # the sm_90 table's: two pages a step
SPLIT_CONFIG = (KernelConfig(16, 16, 1, 2, split_k=3), 64)            # one page a step, three splits
HEADS_FIRST_CONFIG = (KernelConfig(16, 32, 2, 3, split_k=2, heads_first=1), 64)   # heads first, two warps


# the table's config at every magnitude, the others at one each (a magnitude tests the quantization's
# scales, a config the tiling: each pair takes ~19 s in the interpreter, and all nine cost the CPU
# suite three minutes)
@pytest.mark.parametrize("config,head_dim,magnitude", [
    (*TABLE_CONFIG, 1.0), (*TABLE_CONFIG, 300.0), (*TABLE_CONFIG, 1e-3), (*SPLIT_CONFIG, 300.0),
    (*HEADS_FIRST_CONFIG, 1e-3),
], ids=["2pages-auto-D128-unit", "2pages-auto-D128-large", "2pages-auto-D128-tiny", "1page-x3-D64-large",
        "2pages-x2-hf-D64-tiny"])
def test_gqa_decode_matches_reference(monkeypatch, config, head_dim, magnitude):
    """Nanbeige's grouping (6 query heads per KV head): partial last pages, a one-key sequence, a
    sequence of an odd number of pages, shuffled pages; q, K and V scaled by `magnitude` (one key
    dominating the scores for "large", values near FP8's smallest normals for "tiny")."""
    calls = _count_launches(monkeypatch)
    torch.manual_seed(5)
    rng = random.Random(5)
    seq_lens = [rng.randint(40, 90), 1, 70, 203, 48]
    case = random_case(rng, 12, 2, head_dim, torch.float32, seq_lens=seq_lens, query_lens=[1] * 5)
    q_scale = 1.0 if magnitude < 1 else magnitude ** 0.5 / 8
    case = case._replace(q=(case.q * q_scale).to(torch.bfloat16), keys=(case.keys * magnitude).to(torch.bfloat16),
                         values=(case.values * magnitude).to(torch.bfloat16))
    out, ref = _run_fp8(_backend(12, 2, head_dim, config), case, head_dim ** -0.5)
    assert calls, "the batch did not take the TMA kernel"
    assert config.split_k == 0 or calls[0] == config.split_k
    assert torch.isfinite(out).all()
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-2, f"relative max error {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", [KernelConfig(16, 32, 1, 2, split_k=0), KernelConfig(16, 16, 2, 3, split_k=3)],
                         ids=["2pages-auto", "1page-x3"])
def test_gqa_decode_over_16_bit_cache_matches_reference(monkeypatch, dtype, config):
    """A slot-major 16-bit cache (a page's box is its KV head's columns of the page's rows): partial
    last pages, a one-key sequence, shuffled pages, with and without context splits; unused cache
    slots hold NaN, so a read past a sequence's keys fails."""
    calls = _count_launches(monkeypatch)
    rng = random.Random(9)
    case = random_case(rng, 12, 2, 64, dtype, seq_lens=[rng.randint(40, 90), 1, 70, 203], query_lens=[1] * 4)
    out, ref = run_both(_backend(12, 2, 64, config, dtype=dtype, kv_dtype=None), case, plane=1, scale=0.125)
    assert calls, "the batch did not take the TMA kernel"
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err <= {torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype], f"max error {err:.2e}"


@pytest.mark.parametrize("block_n", [16, 32], ids=["1page", "2pages"])
def test_v_scales_rising_and_falling(block_n):
    """V scales that rise page after page (v_ref moves up and the accumulator rescales), with a page
    16 binades below the rest between them (P's factors far below 1), and NaN bytes in the last
    page's slots past the sequence (the interpreter widens FP8 NaN to finite values, so the 16-bit
    test's NaN slots are what checks that those rows are masked): the reference's output."""
    from hal.kernels.launch import run_launch

    torch.manual_seed(3)
    num_blocks, kv_heads, head_dim = 12, 2, 64
    config = KernelConfig(16, block_n, 1, 3, split_k=1)
    backend = _backend(12, kv_heads, head_dim, config)
    layout = backend.kv_layout
    cache = torch.zeros(backend.kv_cache_shape(num_blocks), dtype=torch.uint8)
    layout.values(cache).view(torch.uint8).copy_(
        torch.randn(layout.values(cache).shape).to(torch.float8_e4m3fn).view(torch.uint8))
    scales = layout.head_scales(cache)
    scales[:] = 124
    table = torch.tensor([[3, 7, 1, 9, 5]], dtype=torch.int32)
    for i, (block, exponent) in enumerate(zip(table[0].tolist(), (120, 121, 122, 106, 123))):
        scales[1, block] = exponent + torch.arange(16) % 2          # [KVH, page]
    layout.value_bytes(cache)[:, 5, 11:] = 0x7F                           # e4m3fn NaN in slots 75-79
    q = torch.randn(1, 12, head_dim, dtype=torch.bfloat16)
    seq_lens, starts = torch.tensor([75], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    out = torch.empty_like(q)
    for launch in gqa_decode.gqa_decode_launches(q, layout.values(cache), layout.scales(cache), table, seq_lens,
                                                 starts, 0.125, config, KernelConfig(1, 1, 4, 1), out,
                                                 "interpreter", 64):
        run_launch(launch)
    k = layout.read_blocks(cache, 0, table[0]).reshape(-1, kv_heads, head_dim)[:75]
    v = layout.read_blocks(cache, 1, table[0]).reshape(-1, kv_heads, head_dim)[:75]
    qg = q.float().view(kv_heads, 6, head_dim)
    w = torch.softmax(torch.einsum("gqd,kgd->gqk", qg, k) * 0.125, -1)
    ref = torch.einsum("gqk,kgd->gqd", w, v).reshape(12, head_dim)
    err = ((out[0].float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-2, f"relative max error {err:.2e}"


def test_scores_rising_page_after_page_keep_p_in_fp16():
    """Each page's keys score 12 log2 units above the page before (more than LAZY_MARGIN, less than
    fp16's range over P's V factor): the row maxima must move, or P times its factor overflows fp16."""
    torch.manual_seed(2)
    rng = random.Random(2)
    case = random_case(rng, 12, 2, 64, torch.float32, seq_lens=[80, 37], query_lens=[1, 1])
    keys = torch.zeros_like(case.keys)
    for start, length in ((0, 80), (80, 37)):
        keys[:, start:start + length, :, 0] = 12 / 1.4427 * (torch.arange(length) // 16)[:, None].float()
    q = torch.zeros_like(case.q)
    q[..., 0] = 8.0                                                    # scale 0.125: score = key value
    case = case._replace(q=q.to(torch.bfloat16), keys=keys.to(torch.bfloat16), values=case.values.to(torch.bfloat16))
    for config in (KernelConfig(16, 16, 1, 3, split_k=1), KernelConfig(16, 32, 1, 3, split_k=1)):
        out, ref = _run_fp8(_backend(12, 2, 64, config), case, 0.125)
        assert torch.isfinite(out).all()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-2, f"relative max error {err:.2e}"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # the reduce over the padding row's
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")     # never-written partials
def test_padding_sequences_without_a_query_are_skipped():
    """A graph bucket's padding sequence (no query this step) returns at once: the real rows are as
    without it, split or not, and unsplit nothing is written at its token's row (with splits the
    reduce, as the unified kernel's, writes every row)."""
    from hal.kernels.launch import run_launch

    torch.manual_seed(0)
    backend = _backend(12, 2, 32, KernelConfig(16, 16, 1, 2, split_k=1))
    cache = torch.zeros(backend.kv_cache_shape(6), dtype=torch.uint8)
    values, scales = backend.kv_layout.values(cache), backend.kv_layout.scales(cache)
    values.view(torch.uint8).copy_(torch.randn(values.shape).to(torch.float8_e4m3fn).view(torch.uint8))
    scales.fill_(124)
    q = torch.randn(3, 12, 32, dtype=torch.bfloat16)             # row 2: the padding sequence's token
    table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    for splits in (1, 2):
        config = KernelConfig(16, 16, 1, 2, split_k=splits)
        outs = []
        for seq_lens, starts in (([20, 9], [0, 1, 2]), ([20, 9, 5], [0, 1, 2, 2])):
            out = torch.full_like(q, float("nan"))
            for launch in gqa_decode.gqa_decode_launches(
                    q, values, scales, table[:len(seq_lens)], torch.tensor(seq_lens, dtype=torch.int32),
                    torch.tensor(starts, dtype=torch.int32), 0.2, config, KernelConfig(1, 1, 4, 1), out,
                    "interpreter", 64):
                run_launch(launch)
            outs.append(out)
        assert torch.isfinite(outs[0][:2]).all() and torch.equal(outs[0][:2], outs[1][:2])
        if splits == 1:
            assert outs[1][2].isnan().all()


def test_only_single_token_grouped_fp8_batches_take_it():
    config = KernelConfig(16, 32, 1, 3, split_k=0)
    table = {**configs_for("default"), FP8_KEY: config}
    both = {**table, attend.GQA_TMA_KEY: config}

    def kernel(heads, kv_heads, dtype=torch.float8_e4m3fn, max_query_len=1, configs=table, head_dim=64,
               num_seqs=64, q_dtype=torch.bfloat16):
        backend = TritonPagedAttention(heads, kv_heads, head_dim, q_dtype, CPU, 16, configs=configs,
                                       num_compute_units=132, kv_dtype=dtype)
        cache = torch.zeros(backend.kv_cache_shape(4), dtype=backend.kv_cache_dtype)
        values, scales = backend._views(cache)
        q = torch.empty(num_seqs * max_query_len, heads, head_dim, dtype=q_dtype)
        launches = attend.launches_for(q, values, torch.zeros(num_seqs, 4, dtype=torch.int32),
                                       torch.ones(num_seqs, dtype=torch.int32),
                                       torch.arange(0, num_seqs * max_query_len + 1, max_query_len,
                                                    dtype=torch.int32), max_query_len, 0.1, configs, 132,
                                       torch.empty_like(q), scales)
        return launches[0].kernel.fn.__name__

    assert kernel(48, 8) == "_gqa_decode_kernel"                                   # Nanbeige, 64 sequences
    assert kernel(48, 8, configs=configs_for("default")) == "_paged_attention_kernel"   # table without it
    assert kernel(48, 8, dtype=None) == "_paged_attention_kernel"                  # bf16 cache, no 16-bit entry
    assert kernel(48, 8, dtype=None, configs=both) == "_gqa_decode_kernel"        # ... with one
    assert kernel(16, 16, dtype=None, configs=both) == "_paged_attention_kernel"
    assert kernel(48, 8, max_query_len=2) == "_paged_attention_kernel"             # speculative verify
    assert kernel(48, 8, head_dim=80) == "_paged_attention_kernel"                 # not a whole TMA box
    assert kernel(48, 8, q_dtype=torch.float32) == "_paged_attention_kernel"       # fp32 runs: fp32 products
    assert kernel(16, 16) == "_paged_attention_kernel"                             # multi-head: no group


def test_splits_aim_at_eight_programs_per_compute_unit():
    auto = KernelConfig(16, 32, 1, 3, split_k=0)
    assert gqa_decode.num_splits(64, 8, 132, auto) == 2        # 512 programs -> 1,024
    assert gqa_decode.num_splits(128, 8, 132, auto) == 1
    assert gqa_decode.num_splits(16, 8, 132, auto) == 8
    assert gqa_decode.num_splits(1, 8, 132, auto) == 16        # at most MAX_SPLITS
    assert gqa_decode.num_splits(64, 8, 132, KernelConfig(16, 32, 1, 3, split_k=4)) == 4
