"""The row-stream decode kernel (hal/kernels/row_decode.py) under the Triton interpreter against the
CPU reference: 16-bit and FP8 caches, context splits, padded head dims, graph-padding sequences, scores
that keep rising (the lazy rescale), and the routing that sends only multi-head single-token decode to
it."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from paged_cases import random_case, run_both

from hal.common.torch_attention import TorchPagedAttention
from hal.kernels import attend
from hal.kernels.backend import TritonPagedAttention
from hal.kernels.configs import KernelConfig, configs_for

pytestmark = pytest.mark.usefixtures("interpreted")

CPU = torch.device("cpu")
ROWS = {"attention_row_decode": KernelConfig(1, 32, 4, 2), "attention_row_decode_fp8": KernelConfig(1, 16, 4, 2),
        "kv_write": KernelConfig(32, 1, 4, 1)}
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _backend(heads, kv_heads, head_dim, dtype, num_compute_units, kv_dtype=None, num_stages=2, block_n=None):
    rows = {name: replace(config, num_stages=num_stages, block_n=block_n or config.block_n)
            if name.startswith("attention_row") else config for name, config in ROWS.items()}
    return TritonPagedAttention(heads, kv_heads, head_dim, dtype, CPU, 16, configs={**configs_for("default"), **rows},
                                num_compute_units=num_compute_units, kv_dtype=kv_dtype)


def _count_row_launches(monkeypatch) -> list[int]:
    calls = []
    real = attend.row_decode_launches

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(attend, "row_decode_launches", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_compute_units,head_dim", [(1, 96), (64, 128)], ids=["whole-D96", "split-D128"])
def test_row_decode_matches_reference(monkeypatch, dtype, num_compute_units, head_dim):
    """Partial last tiles, a one-token sequence, tiles across shuffled pages; 1 and 16 context splits
    (short sequences leave splits empty); head dim 96 padded to 128."""
    calls = _count_row_launches(monkeypatch)
    rng = random.Random(7)
    seq_lens = [rng.randint(2, 90), 1, rng.randint(100, 140), 32]
    case = random_case(rng, 4, 4, head_dim, dtype, seq_lens=seq_lens, query_lens=[1] * 4)
    out, ref = run_both(_backend(4, 4, head_dim, dtype, num_compute_units), case, plane=1, scale=head_dim ** -0.5)
    assert calls, "the batch did not take the row kernel"
    assert out.dtype == dtype and torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err <= TOLERANCE[dtype], f"max error {err:.2e}"


@pytest.mark.parametrize("num_compute_units", [1, 64])
@pytest.mark.parametrize("num_stages", [2, 3], ids=["pages-ahead", "pages-per-tile"])
def test_row_decode_over_fp8_cache_matches_reference(monkeypatch, num_compute_units, num_stages):
    """Every key's K and V scale applied in the stream; the unused cache slots hold zeros; both loops
    (pages loaded a tile ahead by hand at 2 stages, per tile at more)."""
    calls = _count_row_launches(monkeypatch)
    rng = random.Random(11)
    case = random_case(rng, 4, 4, 64, torch.bfloat16, seq_lens=[rng.randint(40, 90), 1, 70], query_lens=[1] * 3)
    backend = _backend(4, 4, 64, torch.bfloat16, num_compute_units, kv_dtype=torch.float8_e4m3fn,
                       num_stages=num_stages)
    out, ref = _run_fp8(backend, case, 0.125)
    assert calls
    assert (out.float() - ref).abs().max().item() <= TOLERANCE[torch.bfloat16]


def _run_fp8(backend, case, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(backend output, float32 reference reading the same FP8 cache: the two share the row layout,
    so the difference is the kernel's arithmetic, not two quantizations) on plane 0."""
    heads, head_dim = case.q.shape[1:]
    reference = TorchPagedAttention(heads, case.keys.shape[2], head_dim, torch.float32, CPU, 16,
                                    kv_dtype=torch.float8_e4m3fn)
    assert reference.kv_cache_shape(case.num_blocks) == backend.kv_cache_shape(case.num_blocks)
    cache = torch.zeros(backend.kv_cache_shape(case.num_blocks), dtype=backend.kv_cache_dtype)
    history = backend.build_meta(case.history)
    for p in range(2):
        backend.write_kv(case.keys[p], case.values[p], cache, history, p)
    out = backend.forward(case.q, cache, backend.build_meta(case.step), 0, scale)
    ref = reference.forward(case.q.float(), cache, reference.build_meta(case.step), 0, scale)
    return out, ref


@pytest.mark.parametrize("config,head_dim", [
    (KernelConfig(1, 16, 1, 3), 128),     # the sm_90 table's
    (KernelConfig(1, 8, 1, 4), 128),      # 4 stages, pages per tile
    (KernelConfig(1, 32, 2, 3), 48),      # head dim padded 48 -> 64; a tile over two pages looks each key's up
], ids=["16x1w-D128", "8x1w-D128", "32x2w-D48"])
@pytest.mark.parametrize("magnitude", [1.0, 300.0, 1e-3], ids=["unit", "large", "tiny"])
def test_fp8_row_decode_over_wide_ranges(monkeypatch, config, head_dim, magnitude):
    """q, K and V scaled by `magnitude` (scores of up to ~200 nats for "large": one key dominates;
    values near fp8's smallest normals for "tiny", which the per-key scales absorb): partial last
    tiles, one-key and multi-page sequences, with and without context splits."""
    calls = _count_row_launches(monkeypatch)
    torch.manual_seed(13)
    rng = random.Random(13)
    seq_lens = [rng.randint(40, 90), 1, 70, 203]
    case = random_case(rng, 2, 2, head_dim, torch.float32, seq_lens=seq_lens, query_lens=[1] * 4)
    q_scale = 1.0 if magnitude < 1 else magnitude ** 0.5 / 8
    case = case._replace(q=(case.q * q_scale).to(torch.bfloat16),
                         keys=(case.keys * magnitude).to(torch.bfloat16),
                         values=(case.values * magnitude).to(torch.bfloat16))
    rows = {**ROWS, "attention_row_decode_fp8": config}
    for num_compute_units in (1, 64):
        backend = TritonPagedAttention(2, 2, head_dim, torch.bfloat16, CPU, 16,
                                       configs={**configs_for("default"), **rows},
                                       num_compute_units=num_compute_units, kv_dtype=torch.float8_e4m3fn)
        out, ref = _run_fp8(backend, case, head_dim ** -0.5)
        assert calls and torch.isfinite(out).all()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-2, f"relative max error {err:.2e} ({num_compute_units} compute units)"


def test_padding_sequences_without_a_query_are_skipped():
    """A graph bucket's padding sequence has no query this step: its program returns, and the real
    rows are as without it (launches built directly: the backend's metadata never has such rows)."""
    from hal.kernels.launch import run_launch
    from hal.kernels.row_decode import row_decode_launches

    torch.manual_seed(0)
    cache = torch.randn(2, 4, 16, 2, 32, dtype=torch.bfloat16)
    q = torch.randn(2, 2, 32, dtype=torch.bfloat16)
    table = torch.tensor([[0, 1], [2, 3], [0, 0]], dtype=torch.int32)
    config = ROWS["attention_row_decode"]
    outs = []
    for seq_lens, starts in (([20, 9], [0, 1, 2]), ([20, 9, 5], [0, 1, 2, 2])):
        out = torch.full_like(q, float("nan"))
        for launch in row_decode_launches(q, cache, table[:len(seq_lens)], torch.tensor(seq_lens, dtype=torch.int32),
                                          torch.tensor(starts, dtype=torch.int32), 0.2, config, 1, config, out,
                                          "interpreter"):
            run_launch(launch)
        outs.append(out)
    assert torch.isfinite(outs[0]).all() and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_mixed_batches_leave_their_one_token_rows_to_the_row_kernel(monkeypatch, kv_dtype):
    """Prompt chunks beside one-token sequences (a join, a burst's packed step): the prefill config
    takes the chunks, the row kernel (unsplit, its row entry) the one-token rows (docs/performance.md,
    lever 113). The result matches the reference, and the one-token rows are the bits of the same
    rows decoded alone, unsplit: so an eager mixed step and a packed pass agree to the bit."""
    calls = _count_row_launches(monkeypatch)
    rng = random.Random(5)
    seq_lens = [rng.randint(60, 90), 37, 1, rng.randint(20, 50), 45]
    query_lens = [1, 37, 1, 1, 12]           # decodes, a prompt, a one-token prompt, a chunk with context
    case = random_case(rng, 4, 4, 64, torch.bfloat16, seq_lens=seq_lens, query_lens=query_lens)
    backend = _backend(4, 4, 64, torch.bfloat16, 1, kv_dtype=kv_dtype)
    mixed = backend.build_meta(case.step)
    assert mixed.mixed and mixed.max_query_len == 37
    out, ref = _run_fp8(backend, case, 0.125) if kv_dtype else run_both(backend, case, plane=1, scale=0.125)
    assert len(calls) == 1, "the one-token rows did not take the row kernel"
    err = (out.float() - ref).abs().max().item()
    assert torch.isfinite(out).all() and err <= TOLERANCE[torch.bfloat16], f"max error {err:.2e}"

    # the same one-token rows as a decode batch of their own (1 compute unit: unsplit)
    singles = [i for i, n in enumerate(query_lens) if n == 1]
    starts = [sum(query_lens[:i]) for i in singles]
    alone = case._replace(step=case.step._replace(query_lens=[1] * len(singles),
                                                 seq_lens=[seq_lens[i] for i in singles],
                                                 block_tables=[[t[i] for i in singles] for t in case.step.block_tables]),
                          q=case.q[starts])
    out_alone, _ = _run_fp8(backend, alone, 0.125) if kv_dtype else run_both(backend, alone, plane=1, scale=0.125)
    assert torch.equal(out[starts], out_alone)

    # a table without the row kernel, and grouped queries, keep the prefill config for every row
    calls.clear()
    plain = TritonPagedAttention(4, 4, 64, torch.bfloat16, CPU, 16, configs={**configs_for("default"),
                                 "kv_write": ROWS["kv_write"]}, num_compute_units=1, kv_dtype=kv_dtype)
    out_plain, _ = _run_fp8(plain, case, 0.125) if kv_dtype else run_both(plain, case, plane=1, scale=0.125)
    assert not calls and (out_plain.float() - ref).abs().max().item() <= TOLERANCE[torch.bfloat16]
    gqa = random_case(rng, 4, 2, 64, torch.bfloat16, seq_lens=seq_lens, query_lens=query_lens)
    run_both(_backend(4, 2, 64, torch.bfloat16, 1), gqa, plane=1, scale=0.125)
    assert not calls


def test_single_token_decode_takes_the_row_kernel_grouped_queries_only_when_split():
    def key(dtype, heads, kv_heads, max_query_len, quantized, num_seqs=64):
        return attend.row_decode_key(dtype, heads, kv_heads, max_query_len, quantized, num_seqs, 132)

    assert key(torch.bfloat16, 16, 16, 1, False) == "attention_row_decode"
    assert key(torch.float16, 16, 16, 1, True) == "attention_row_decode_fp8"
    assert key(torch.bfloat16, 16, 4, 1, False) is None                 # grouped queries, 64 sequences
    assert key(torch.bfloat16, 48, 8, 1, False, num_seqs=1) == "attention_row_decode"   # Nanbeige, batch 1
    assert key(torch.bfloat16, 48, 8, 1, True, num_seqs=4) == "attention_row_decode_fp8"
    assert key(torch.bfloat16, 48, 8, 1, False, num_seqs=8) is None     # one program per head fills the GPU
    assert key(torch.bfloat16, 12, 8, 1, False, num_seqs=1) is None     # not a whole group per KV head
    assert key(torch.bfloat16, 16, 16, 2, False) is None                # speculative verify
    assert key(torch.float32, 16, 16, 1, False) is None                 # golden runs: tf32x3 kernel
    with pytest.raises(ValueError, match="whole number of query heads per KV head"):
        from hal.kernels.row_decode import row_decode_launches

        q = torch.empty(1, 3, 32)
        row_decode_launches(q, torch.empty(2, 1, 16, 2, 32), torch.zeros(1, 1, dtype=torch.int32),
                            torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 0.1,
                            ROWS["attention_row_decode"], 1, ROWS["attention_row_decode"], q, "interpreter")


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_grouped_query_decode_on_the_row_kernel_matches_reference(monkeypatch, kv_dtype):
    """Nanbeige's grouping (6 query heads per KV head) at a few sequences: each query head's program
    reads its KV head's keys, with context splits; head dim 64."""
    calls = _count_row_launches(monkeypatch)
    rng = random.Random(11)
    seq_lens = [rng.randint(40, 90), 1, 33]
    case = random_case(rng, 12, 2, 64, torch.bfloat16, seq_lens=seq_lens, query_lens=[1] * 3)
    backend = _backend(12, 2, 64, torch.bfloat16, 64, kv_dtype=kv_dtype)
    out, ref = _run_fp8(backend, case, 0.125) if kv_dtype else run_both(backend, case, plane=1, scale=0.125)
    assert calls, "the batch did not take the row kernel"
    assert torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16], f"max error {err:.2e}"


def test_split_and_dense_batches_take_their_config_where_the_table_has_one():
    """`attention_row_decode_split` serves 16-bit caches whose context splits 16 ways (a sequence or
    two), `attention_row_decode_split_fp8` 8-bit ones; fewer splits and unsplit batches keep the
    row entries, and a table without the split entry uses the row entry. Batches with many programs
    per compute unit take `attention_row_decode_dense(_fp8)` where the table has it, batches split
    2-15 ways `attention_row_decode_split_few(_fp8)`."""
    split = KernelConfig(1, 8, 1, 2)
    configs = {**ROWS, "attention_reduce": KernelConfig(1, 1, 1, 1), attend.SPLIT_ROW_KEY: split}

    def block_n(num_seqs, table, kv_scales=None, dtype=torch.bfloat16):
        cache = torch.empty(2, 4, 16, 2, 32, dtype=dtype)
        q = torch.empty(num_seqs, 2, 32, dtype=torch.bfloat16)
        launches = attend.launches_for(q, cache, torch.zeros(num_seqs, 4, dtype=torch.int32),
                                       torch.ones(num_seqs, dtype=torch.int32),
                                       torch.arange(num_seqs + 1, dtype=torch.int32), 1, 0.1, table, 64,
                                       torch.empty_like(q), kv_scales)
        return launches[0].kwargs["BLOCK_N"], len(launches)

    assert block_n(1, configs) == (8, 2)                 # 16 splits: the split entry, and the reduce
    assert block_n(8, configs) == (ROWS["attention_row_decode"].block_n, 2)          # 8 splits
    assert block_n(64, configs) == (ROWS["attention_row_decode"].block_n, 1)
    assert block_n(1, {k: v for k, v in configs.items() if k != attend.SPLIT_ROW_KEY})[0] == \
        ROWS["attention_row_decode"].block_n
    fp8 = block_n(1, configs, torch.ones(2, 4, 16, 2), torch.float8_e4m3fn)
    assert fp8[0] == ROWS["attention_row_decode_fp8"].block_n
    split_fp8 = {**configs, attend.SPLIT_ROW_KEY + "_fp8": KernelConfig(1, 4, 1, 2)}
    assert block_n(1, split_fp8, torch.ones(2, 4, 16, 2), torch.float8_e4m3fn)[0] == 4
    assert block_n(64, split_fp8, torch.ones(2, 4, 16, 2), torch.float8_e4m3fn)[0] == \
        ROWS["attention_row_decode_fp8"].block_n
    # at least DENSE_ROW_MIN_PROGRAMS (sequence, head) programs per compute unit: the dense entry
    dense = {**split_fp8, attend.DENSE_ROW_KEY + "_fp8": KernelConfig(1, 2, 1, 3)}
    many = attend.DENSE_ROW_MIN_PROGRAMS * 64 // 2                 # 2 heads per sequence, 64 units
    assert block_n(many, dense, torch.ones(2, 4, 16, 2), torch.float8_e4m3fn) == (2, 1)
    assert block_n(many - 1, dense, torch.ones(2, 4, 16, 2), torch.float8_e4m3fn)[0] == \
        ROWS["attention_row_decode_fp8"].block_n
    assert block_n(many, dense)[0] == ROWS["attention_row_decode"].block_n     # no 16-bit dense entry
    # 2-15 splits: the few-splits entry where the table has it
    few = {**configs, attend.FEW_SPLITS_ROW_KEY: KernelConfig(1, 2, 1, 3),
           attend.FEW_SPLITS_ROW_KEY + "_fp8": KernelConfig(1, 32, 1, 3)}
    assert block_n(8, few) == (2, 2) and block_n(1, few) == (8, 2) and block_n(64, few)[0] == \
        ROWS["attention_row_decode"].block_n
    assert block_n(8, few, torch.ones(2, 4, 16, 2), torch.float8_e4m3fn)[0] == 32


def test_rising_scores_move_the_lazy_maximum(monkeypatch):
    """Keys whose scores climb by 4 lazy margins per tile, then a plateau: each stream's reference
    maximum must move whenever a score passes it by more than 2^LAZY_MARGIN (a missed move sends p
    past fp32's range within a few tiles), and the result equals the reference."""
    from hal.kernels.row_tiles import LAZY_MARGIN

    calls = _count_row_launches(monkeypatch)
    rng = random.Random(5)
    head_dim, seq_lens = 32, [150, 70]
    case = random_case(rng, 2, 2, head_dim, torch.float32, seq_lens=seq_lens, query_lens=[1, 1])
    q = case.q
    ramp = torch.arange(sum(seq_lens)).float().clamp(max=110) * (4 * LAZY_MARGIN.value / 16) / 1.4427  # nats
    direction = torch.cat([q[0].expand(seq_lens[0], -1, -1), q[1].expand(seq_lens[1], -1, -1)])       # [T, H, D]
    keys = case.keys[0] * 0.1 + direction * (ramp / direction.pow(2).sum(-1).mean(-1))[:, None, None]
    case = case._replace(keys=torch.stack([keys, case.keys[1]]).to(torch.bfloat16),
                         values=case.values.to(torch.bfloat16), q=case.q.to(torch.bfloat16))
    out, ref = run_both(_backend(2, 2, head_dim, torch.bfloat16, 1), case, plane=0, scale=1.0)
    assert calls and torch.isfinite(out).all()
    err = (out.float() - ref).abs().max().item()
    assert err <= TOLERANCE[torch.bfloat16], f"max error {err:.2e}"


def _poison_slot(backend, cache: torch.Tensor, slot: int) -> None:
    """Every byte the slot stores set to 0xFF: NaN in bf16 and fp8 values, an infinite exponent-byte
    scale, NaN in a float32 one."""
    layout = backend.kv_layout
    if layout is None:
        cache.view(torch.uint8).view(2, -1, cache[0, 0, 0].numel() * cache.element_size())[:, slot] = 0xFF
        return
    layout.value_bytes(cache)[:, slot // layout.block_size, slot % layout.block_size] = 0xFF
    scales = layout.head_scales(cache)
    scales[:, slot // layout.block_size, :, slot % layout.block_size] = \
        0xFF if scales.dtype == torch.uint8 else float("nan")


@pytest.mark.parametrize("kv_dtype,head_dim,interleaved", [
    (None, 128, False), (None, 96, True), (torch.float8_e4m3fn, 64, False), (torch.float8_e4m3fn, 48, True),
], ids=["bf16-neox-D128", "bf16-gptj-D96", "fp8-neox-D64", "fp8-gptj-D48"])
@pytest.mark.parametrize("num_compute_units,kv_heads", [(1, 4), (64, 4), (64, 2)],
                         ids=["whole", "split", "split-grouped"])
@pytest.mark.parametrize("block_n,num_stages", [(None, 2), (8, 3)], ids=["table-tiles", "8-key-tiles"])
def test_row_kernel_rotary_is_rotary_kv_write_then_the_row_kernel_bit_for_bit(monkeypatch, kv_dtype, head_dim,
                                                                              interleaved, num_compute_units,
                                                                              kv_heads, block_n, num_stages):
    """`attend_rotary` at decode with context splits (multi-head, and grouped: every program of a
    group stores the same bytes): the row kernel rotates q and stores this step's k and v (the split
    that reads the last key) in one launch, the same output and cache bytes as `rotary_kv_write` then
    the row kernel; without splits the two launches stay (`attend.fuses_rotary`). The last slots hold
    NaN until written, so a read before the store fails; one token's slot is -1 (nothing stored: its
    stale key is read, as in the two-launch path). 8-key tiles over 3 stages (the few-splits entry's
    shape) give splits of several tiles: an early tile, the loop, the last tile full or partial."""
    from hal.kernels import rotary_kv

    rng = random.Random(17)
    seq_lens = [rng.randint(2, 90), 1, rng.randint(100, 140), 32, 17]
    case = random_case(rng, 4, kv_heads, head_dim, torch.bfloat16, seq_lens=seq_lens, query_lens=[1] * 5)
    backend = _backend(4, kv_heads, head_dim, torch.bfloat16, num_compute_units, kv_dtype=kv_dtype,
                       num_stages=num_stages, block_n=block_n)
    cache = torch.zeros(backend.kv_cache_shape(case.num_blocks), dtype=backend.kv_cache_dtype)
    history = backend.build_meta(case.history)
    for p in range(2):
        backend.write_kv(case.keys[p], case.values[p], cache, history, p)
    meta = backend.build_meta(case.step)
    plane, stale = 1, 3                              # sequence 3 keeps its slot's old key (slot -1)
    slots = meta.slot_mapping.clone()
    slots[plane, stale] = -1
    meta = meta._replace(slot_mapping=slots)
    for s in range(len(seq_lens)):
        if s != stale:
            _poison_slot(backend, cache, int(meta.slot_mapping[plane, s]))
    q = torch.randn(5, 4, head_dim).bfloat16()
    k, v = (torch.randn(5, kv_heads, head_dim).bfloat16() for _ in range(2))
    positions = torch.tensor(seq_lens) - 1
    writes = []
    real_write = rotary_kv.rotary_kv_write
    monkeypatch.setattr(rotary_kv, "rotary_kv_write", lambda *a, **kw: writes.append(1) or real_write(*a, **kw))
    calls = _count_row_launches(monkeypatch)
    fused_cache, plain_cache = cache.clone(), cache.clone()
    fused = backend.attend_rotary(q, k, v, fused_cache, meta, plane, positions, 1e4, interleaved, head_dim ** -0.5)
    assert calls and bool(writes) == (num_compute_units == 1), "small batches rotate inside the row kernel"
    values, scales = backend._views(plain_cache)
    q_rot = real_write(q, k, v, positions, 1e4, interleaved, values, meta.slot_mapping[plane],
                       backend.configs["rotary"], kv_scales=scales)
    plain = backend.forward(q_rot, plain_cache, meta, plane, head_dim ** -0.5)
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, plain)
    assert torch.equal(fused_cache.view(torch.uint8), plain_cache.view(torch.uint8))
