"""Paged attention and KV write kernels under the Triton interpreter against the CPU reference."""
from __future__ import annotations

import random

import pytest
import torch
from paged_cases import random_case, run_both

from hal.kernels.attention import config_key
from hal.kernels.splits import num_kv_splits
from hal.kernels.backend import TritonPagedAttention
from hal.kernels.configs import KernelConfig, all_configs, configs_for
from kernel_reference import write_kv_ref

pytestmark = pytest.mark.usefixtures("interpreted")

CPU = torch.device("cpu")
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
SHAPES = [  # (heads, kv heads, head dim): GQA 1/2/4/8 (and 6, Nanbeige), head dims 24/40/80/96/128
    (2, 2, 24), (4, 2, 40), (8, 2, 80), (8, 1, 96), (4, 4, 128), (12, 2, 24),
]


# The history writes of the attention tests move 32 tokens per program (the interpreter pays per
# program); the kv_write configs the Hals use are tested on their own below.
FAST_WRITE = KernelConfig(32, 1, 4, 1)


def _backend(heads, kv_heads, head_dim, dtype, configs=None, num_compute_units=4, block_size=16):
    configs = {**(configs or configs_for("default")), "kv_write": FAST_WRITE}
    return TritonPagedAttention(heads, kv_heads, head_dim, dtype, CPU, block_size, configs=configs,
                                num_compute_units=num_compute_units)


def _assert_close(out, ref, dtype, what):
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    err = (out.float() - ref).abs().max().item()
    assert err <= TOLERANCE[dtype], f"{what}: max error {err:.2e} > {TOLERANCE[dtype]:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}-KVH{s[1]}-D{s[2]}")
def test_mixed_batch_matches_reference(shape, dtype):
    """Prefill, chunked prefill and decode in one launch, on the second of two planes."""
    heads, kv_heads, head_dim = shape
    case = random_case(random.Random(), heads, kv_heads, head_dim, dtype)
    out, ref = run_both(_backend(*shape, dtype), case, plane=1, scale=head_dim ** -0.5)
    _assert_close(out, ref, dtype, f"{shape} {dtype}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_compute_units", [1, 8, 64])
def test_decode_split_matches_reference(num_compute_units, dtype):
    """Decode-only batches take the context split (1, 4 and 16 splits here) and the reduce; short
    sequences leave some splits empty."""
    rng = random.Random()
    seq_lens = [rng.randint(1, 90), 1, rng.randint(40, 130)]
    case = random_case(rng, 8, 2, 40, dtype, seq_lens=seq_lens, query_lens=[1, 1, 1])
    backend = _backend(8, 2, 40, dtype, num_compute_units=num_compute_units)
    assert num_kv_splits(3, 2, num_compute_units) == {1: 1, 8: 4, 64: 16}[num_compute_units]
    out, ref = run_both(backend, case, plane=0, scale=0.2)
    _assert_close(out, ref, dtype, f"{num_compute_units} CUs")


def test_speculative_queries_use_decode_config_with_split():
    """Up to DECODE_MAX_QUERY_LEN new tokens per sequence still run split, causally within the run."""
    rng = random.Random()
    case = random_case(rng, 4, 1, 64, torch.float32, seq_lens=[37, 70], query_lens=[5, 8])
    out, ref = run_both(_backend(4, 1, 64, torch.float32, num_compute_units=16), case, plane=1, scale=0.125)
    _assert_close(out, ref, torch.float32, "spec decode")


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [3, 1, 2]], ids=["decode", "spec"])
def test_heads_first_grid_gives_the_same_bits(query_lens):
    """`heads_first` only reorders the programs: every output bit is as with query blocks first."""
    rng = random.Random(3)
    case = random_case(rng, 8, 2, 40, torch.bfloat16, seq_lens=[50, 17, 90], query_lens=query_lens)
    outs = []
    for first in (0, 1):
        configs = {**configs_for("default"), "attention_decode": KernelConfig(16, 32, 4, 1, heads_first=first)}
        outs.append(run_both(_backend(8, 2, 40, torch.bfloat16, configs=configs, num_compute_units=8), case, 1, 0.2)[0])
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


def _attention_tiles() -> list[tuple[str, KernelConfig, torch.dtype]]:
    seen = {}
    for arch, table in all_configs().items():
        for name, config in table.items():
            if name.startswith("attention_") and name != "attention_reduce" and "row_decode" not in name:
                dtype = torch.float32 if name.endswith("_fp32") else torch.bfloat16
                seen.setdefault((config.block_m, config.block_n, dtype), (f"{arch}-{name}", config, dtype))
    return list(seen.values())


@pytest.mark.parametrize("label,config,dtype", _attention_tiles(),
                         ids=lambda v: v if isinstance(v, str) else "")
def test_every_attention_tile_a_hal_can_choose(label, config, dtype):
    """Each distinct (block_m, block_n, dtype) of every arch's table, as prefill and as split decode."""
    configs = {**configs_for("default"), config_key("prefill", dtype): config,
               config_key("decode", dtype): config}
    rng = random.Random()
    backend = _backend(8, 2, 128, dtype, configs=configs, num_compute_units=8)
    mixed = random_case(rng, 8, 2, 128, dtype, num_planes=1, seq_lens=[140, 9, 40], query_lens=[70, 9, 1])
    _assert_close(*run_both(backend, mixed, 0, 0.09), dtype, f"{label} mixed")
    decode = random_case(rng, 8, 2, 128, dtype, num_planes=1, seq_lens=[100, 33], query_lens=[1, 1])
    _assert_close(*run_both(backend, decode, 0, 0.09), dtype, f"{label} decode")


def test_page_size_larger_than_key_tile():
    """Pages of 64 tokens with 32-key tiles (several tiles per page), fp32."""
    case = random_case(random.Random(), 4, 2, 32, torch.float32, block_size=64, num_planes=1,
                       seq_lens=[130, 64, 5], query_lens=[70, 1, 5])
    out, ref = run_both(_backend(4, 2, 32, torch.float32, block_size=64), case, plane=0, scale=0.3)
    _assert_close(out, ref, torch.float32, "page 64")


def _kv_write_configs() -> list[KernelConfig]:
    return sorted({table["kv_write"] for table in all_configs().values()} | {KernelConfig(4, 1, 4, 1)},
                  key=repr)


@pytest.mark.parametrize("config", _kv_write_configs(), ids=lambda c: f"block{c.block_m}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kv_write_matches_reference_and_skips_minus_one(dtype, config):
    heads, head_dim, num_tokens = 3, 40, 9
    backend = TritonPagedAttention(6, heads, head_dim, dtype, CPU, 16, configs={**configs_for("default"),
                                   "kv_write": config}, num_compute_units=4)
    qkv = torch.randn(num_tokens, 6 + 2 * heads, head_dim).to(dtype)        # fused projection: strided k, v
    k, v = qkv[:, 6:6 + heads], qkv[:, 6 + heads:]
    slots = torch.randperm(5 * 16)[:num_tokens]
    slots[[1, 6]] = -1
    cache = torch.randn(backend.kv_cache_shape(5)).to(dtype)
    expected = cache.clone()
    write_kv_ref(k, v, expected, slots)
    meta = backend.build_meta(random_case(random.Random(), 6, heads, head_dim, dtype).step)
    backend.write_kv(k, v, cache, meta._replace(slot_mapping=slots[None]), plane=0)
    assert torch.equal(cache, expected)


def test_read_after_write_round_trip():
    backend = _backend(4, 2, 24, torch.bfloat16)
    case = random_case(random.Random(), 4, 2, 24, torch.bfloat16, num_planes=2)
    cache = torch.zeros(backend.kv_cache_shape(case.num_blocks), dtype=torch.bfloat16)
    meta = backend.build_meta(case.history)
    for plane in range(2):
        backend.write_kv(case.keys[plane], case.values[plane], cache, meta, plane)
        k, v = backend.read_kv(cache, meta.slot_mapping[plane])
        assert torch.equal(k, case.keys[plane]) and torch.equal(v, case.values[plane])
