"""The decode projections of hal/kernels/gemv.py (through gemv_ops.py) under the Triton interpreter,
against the torch expressions that define them (`Hal.op`'s docstring) and the zoo layers."""
from __future__ import annotations

import pytest
import torch
from kernel_reference import rms_norm_ref, silu_and_mul_ref, w8a8_slices_ref

from hal.kernels import gemv, gemv_ops, gemv_slice
from hal.kernels.configs import KernelConfig, all_configs, configs_for

pytestmark = pytest.mark.usefixtures("interpreted")

# small tiles so the interpreter runs several column blocks and K steps; every path once:
# FMA (one row) with and without the register prefetch, tl.dot (rows padded to 16), split-K
FMA = KernelConfig(1, 16, 4, 1, block_k=32, split_k=1)
FMA_PREFETCH_SPLIT = KernelConfig(1, 16, 4, 2, block_k=32, split_k=3)
DOT = KernelConfig(16, 16, 4, 2, block_k=32, split_k=1)
DOT_SPLIT = KernelConfig(16, 32, 4, 2, block_k=16, split_k=0)
# one row through hal/kernels/gemv_slice.py: all of K in one slice (masked), and K over 3 slices
SLICE = KernelConfig(1, 4, 4, 1, block_k=256)
SLICE_SPLIT = KernelConfig(1, 8, 2, 1, block_k=32)
PATHS = {"fma": FMA, "fma-prefetch-split3": FMA_PREFETCH_SPLIT, "dot": DOT, "dot-autosplit": DOT_SPLIT,
         "slice": SLICE, "slice-split": SLICE_SPLIT}


def _ops(config: KernelConfig) -> gemv_ops.Gemv:
    slices = {gemv_ops.SLICE_KEY: config} if config in (SLICE, SLICE_SPLIT) else {}
    return gemv_ops.Gemv({**configs_for("default"), "gemv_m1": config, "gemv": config, **slices},
                         num_compute_units=16)


def _rows_for(config: KernelConfig) -> list[int]:
    return [1] if config.block_m == 1 else [1, 3, 8]


def _assert_bits(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """At most one ulp apart and nearly all bits equal: the row statistics are fp32 sums in another
    order than torch's, which can move a rounding by one ulp now and then."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, f"{what}: {out.dtype}{tuple(out.shape)}"
    ulp = ref.float().abs().clamp_min(1e-30) * 2 ** -7
    assert ((out.float() - ref.float()).abs() <= ulp * 1.01).all(), f"{what}: more than one ulp off"
    assert (out == ref).float().mean().item() >= 0.98, f"{what}: too few bits equal"


def _assert_product(out: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, what: str,
                    residual: torch.Tensor | None = None) -> None:
    """`out` is the fp32 product of the exact input `a` rounded once (plus the residual, rounded as
    torch rounds `residual + y`): within one ulp of the float64 truth."""
    ref = a.double() @ weight.double().T
    if residual is not None:
        ref = residual.double() + ref.to(out.dtype).double()
    assert torch.isfinite(out).all(), what
    err = (out.double() - ref).abs()
    tol = ref.abs().clamp_min(1e-3) * 2 ** -7 + 1e-4
    assert (err <= tol).all(), f"{what}: error {err.max().item():.3g}"


def _permutation(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A permutation matrix: the product returns the (permuted) input exactly, so the prologue's
    output can be compared bit for bit."""
    return torch.eye(n, dtype=dtype)[torch.randperm(n)]


@pytest.mark.parametrize("stats", ["one-pass", "chunked"])
@pytest.mark.parametrize("path", PATHS, ids=list(PATHS))
def test_prologues_feed_the_product_what_torch_computes(path, stats, monkeypatch):
    """Row statistics from one tile in registers, or in chunks over K (rows wider than STATS_ELEMENTS)."""
    if stats == "chunked":
        if path not in ("fma", "dot", "slice-split"):
            pytest.skip("one chunked case per product path")
        monkeypatch.setattr(gemv, "STATS_ELEMENTS", 32)
    config = PATHS[path]
    k = 96
    eye = _permutation(k, torch.bfloat16)
    norm_w, post_w = torch.randn(k).bfloat16(), torch.randn(k).bfloat16()
    ops = _ops(config)
    for rows in _rows_for(config):
        x, residual = (torch.randn(rows, k) * 3).bfloat16(), torch.randn(rows, k).bfloat16()
        gate_up = (torch.randn(rows, 2 * k) * 2).bfloat16()
        _assert_bits(ops.linear(x, eye), x @ eye.T, f"{path} linear rows={rows}")
        _assert_bits(ops.rms_norm_linear(x, norm_w, 1e-6, eye), rms_norm_ref(x, norm_w, 1e-6) @ eye.T,
                     f"{path} rms_norm rows={rows}")
        _assert_bits(ops.silu_mul_linear(gate_up, eye), silu_and_mul_ref(gate_up) @ eye.T,
                     f"{path} silu_and_mul rows={rows}")
        for sum_first in (False, True):
            y, h = ops.norm_residual_linear(x, residual, post_w, norm_w, 1e-6, eye, sum_first=sum_first)
            h_ref = rms_norm_ref(x + residual, post_w, 1e-6) if sum_first else rms_norm_ref(x, post_w, 1e-6, residual)
            _assert_bits(h, h_ref, f"{path} stream sum_first={sum_first} rows={rows}")
            _assert_bits(y, rms_norm_ref(h_ref, norm_w, 1e-6) @ eye.T, f"{path} sandwich rows={rows}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("path", PATHS, ids=list(PATHS))
def test_products_round_once(path, dtype):
    """Random weights, K not a multiple of the tile (masked tail), N not a multiple of the block."""
    config = PATHS[path]
    n, k = 72, 200
    weight = (torch.randn(n, k) / k ** 0.5).to(dtype)
    ops = _ops(config)
    for rows in _rows_for(config):
        x = torch.randn(2, rows, k).to(dtype)[1]                   # a view with an offset
        out_res = torch.randn(rows, n).to(dtype)
        _assert_product(ops.linear(x, weight), x, weight, f"{path} linear")
        _assert_product(ops.linear(x, weight, out_res), x, weight, f"{path} +residual", out_res)
        norm_w = torch.randn(k).to(dtype)
        _assert_product(ops.rms_norm_linear(x, norm_w, 1e-5, weight), rms_norm_ref(x, norm_w, 1e-5), weight,
                        f"{path} rms_norm")
        gate_up = torch.randn(rows, 2 * k).to(dtype)
        _assert_product(ops.silu_mul_linear(gate_up, weight, out_res), silu_and_mul_ref(gate_up), weight,
                        f"{path} silu_and_mul +residual", out_res)


@pytest.mark.parametrize("rows", [20, 64])
def test_wide_row_blocks(rows, monkeypatch):
    """Past 16 rows a program holds the next power of two (batch-64/128 decode, "gemv_wide")."""
    monkeypatch.setattr(gemv_ops, "MAX_ROWS", gemv.MAX_DOT_ROWS)
    n, k = 40, 96
    weight = (torch.randn(n, k) / k ** 0.5).bfloat16()
    ops = _ops(DOT_SPLIT)
    assert gemv.plan(rows, n, k, DOT_SPLIT, 16).block_m == (32 if rows == 20 else 64)
    x, out_res = torch.randn(rows, k).bfloat16(), torch.randn(rows, n).bfloat16()
    _assert_product(ops.linear(x, weight, out_res), x, weight, "wide +residual", out_res)
    gate_up = torch.randn(rows, 2 * k).bfloat16()
    _assert_product(ops.silu_mul_linear(gate_up, weight), silu_and_mul_ref(gate_up), weight, "wide silu_and_mul")
    with pytest.raises(ValueError, match="at most 128 rows"):
        gemv.plan(129, n, k, DOT_SPLIT, 16)


@pytest.mark.parametrize("rows", [9, 64])
def test_wide_entry_takes_decode_batches_past_max_rows(rows, monkeypatch):
    """A table with `gemv_wide` runs MAX_ROWS+1..MAX_DOT_ROWS rows on the tl.dot path, the first weight
    tile of each split loaded before the PDL wait: the same bits as the launch without the preload."""
    from hal.kernels.launch import run_launch

    wide = KernelConfig(16, 16, 4, 2, block_k=32, split_k=3)
    ops = gemv_ops.Gemv({**configs_for("default"), "gemv_wide": wide}, num_compute_units=16, max_rows=1)
    launches = []
    monkeypatch.setattr(gemv_ops, "run_launch", lambda launch: launches.append(launch) or run_launch(launch))
    n, k = 40, 96
    weight = (torch.randn(n, k) / k ** 0.5).bfloat16()
    x, out_res = torch.randn(rows, k).bfloat16(), torch.randn(rows, n).bfloat16()
    y = ops.linear(x, weight, out_res)
    _assert_product(y, x, weight, "wide +residual", out_res)
    assert len(launches) == 1 and launches[0].kwargs["PRELOAD"] and launches[0].kwargs["SPLIT_K"] == 3
    plain = torch.empty_like(y)
    run_launch(gemv.gemv_launch(x, weight, plain, wide, "cpu", 16, out_residual=out_res,
                                workspace=torch.empty(3 * rows * n), counters=torch.zeros(8, dtype=torch.int32)))
    assert torch.equal(y, plain)
    gate_up = torch.randn(rows, 2 * k).bfloat16()
    _assert_product(ops.silu_mul_linear(gate_up, weight), silu_and_mul_ref(gate_up), weight, "wide silu_and_mul")
    assert ops.projection_takes(rows, k) and not ops.projection_takes(4, k)     # 2..8 rows stay on the GEMM
    assert not gemv_ops.split_counters(torch.device("cpu")).any()


def test_prologue_switches_give_the_same_function(monkeypatch):
    """Above NORM_PROLOGUE_MAX_ROWS / SANDWICH_PROLOGUE_MAX_ROWS the norms run as their own launch
    first: the same values (up to the statistics' sum order)."""
    ops = _ops(DOT)
    k = 64
    eye = _permutation(k, torch.bfloat16)
    x, residual = torch.randn(3, k).bfloat16(), torch.randn(3, k).bfloat16()
    w1, w2 = torch.randn(k).bfloat16(), torch.randn(k).bfloat16()
    fused = ops.rms_norm_linear(x, w1, 1e-6, eye), *ops.norm_residual_linear(x, residual, w1, w2, 1e-6, eye)
    monkeypatch.setattr(gemv_ops, "NORM_PROLOGUE_MAX_ROWS", 0)
    monkeypatch.setattr(gemv_ops, "SANDWICH_PROLOGUE_MAX_ROWS", 0)
    split = ops.rms_norm_linear(x, w1, 1e-6, eye), *ops.norm_residual_linear(x, residual, w1, w2, 1e-6, eye)
    for a, b in zip(fused, split):
        _assert_bits(a, b, "prologue vs own launch")


def test_split_k_is_deterministic_and_leaves_counters_zero():
    ops = _ops(FMA_PREFETCH_SPLIT)
    weight = torch.randn(48, 160).bfloat16()
    x = torch.randn(1, 160).bfloat16()
    first = ops.linear(x, weight)
    assert torch.equal(first, ops.linear(x, weight))
    assert gemv.plan(1, 48, 160, FMA_PREFETCH_SPLIT, 16).split_k == 3
    assert not gemv_ops.split_counters(torch.device("cpu")).any()


def test_rows_do_not_depend_on_their_neighbours():
    """A padded decode bucket (graphs) and the same rows alone compute the same bits per row."""
    ops = _ops(DOT)
    weight = torch.randn(64, 128).bfloat16()
    x = torch.randn(8, 128).bfloat16()
    assert torch.equal(ops.linear(x, weight)[:3], ops.linear(x[:3], weight))
    assert torch.equal(ops.rms_norm_linear(x, weight[0], 1e-6, weight)[2:5],
                       ops.rms_norm_linear(x[2:5], weight[0], 1e-6, weight))


def test_other_shapes_and_dtypes_take_the_unfused_path_bit_for_bit():
    """More than MAX_ROWS rows, or float32: the small-op kernels and F.linear, exactly the path the
    model takes without these ops."""
    from hal.kernels.ops import rms_norm, silu_and_mul

    ops = _ops(FMA)
    for dtype, rows in ((torch.bfloat16, gemv_ops.MAX_ROWS + 1), (torch.float32, 1)):
        x, residual = torch.randn(rows, 64).to(dtype), torch.randn(rows, 64).to(dtype)
        weight, w1, w2 = torch.randn(32, 64).to(dtype), torch.randn(64).to(dtype), torch.randn(64).to(dtype)
        linear = torch.nn.functional.linear
        assert torch.equal(ops.linear(x, weight, residual[:, :32]), residual[:, :32] + linear(x, weight))
        assert torch.equal(ops.rms_norm_linear(x, w1, 1e-6, weight), linear(rms_norm(x, w1, 1e-6), weight))
        gate_up = torch.randn(rows, 128).to(dtype)
        assert torch.equal(ops.silu_mul_linear(gate_up, weight), linear(silu_and_mul(gate_up), weight))
        y, h = ops.norm_residual_linear(x, residual, w1, w2, 1e-6, weight)
        assert torch.equal(h, rms_norm(x, w1, 1e-6, residual))
        assert torch.equal(y, linear(rms_norm(h, w2, 1e-6), weight))
        y, h = ops.norm_residual_linear(x, residual, w1, w2, 1e-6, weight, sum_first=True)
        assert torch.equal(h, rms_norm(x + residual, w1, 1e-6))


def test_every_gemv_config_a_hal_can_choose():
    """Each distinct gemv config of every arch table, at a toy shape (one row and three)."""
    configs = {c for table in all_configs().values() for key, c in table.items() if key.startswith("gemv")}
    weight = (torch.randn(40, 1040) / 32).bfloat16()
    norm_w = torch.randn(1040).bfloat16()
    for config in configs:
        ops = _ops(config)
        for rows in (1, 3):
            x = torch.randn(rows, 1040).bfloat16()
            _assert_product(ops.rms_norm_linear(x, norm_w, 1e-6, weight), rms_norm_ref(x, norm_w, 1e-6), weight,
                            f"{config} rows={rows}")


def test_plan_fills_the_device_and_keeps_splits_whole():
    sm90 = all_configs()["sm_90"]
    assert gemv.plan(1, 2048, 2048, sm90["gemv_m1"], 132) == gemv.Plan(1, 2, 1024)     # o_proj: 128 blocks
    assert gemv.plan(1, 6144, 2048, sm90["gemv_m1"], 132).split_k == 1                # q|k|v: 384 blocks
    assert gemv.plan(4, 2048, 5632, sm90["gemv"], 132).split_k == 4                   # down: 64 blocks
    for rows, n, k in ((1, 2048, 5632), (8, 2048, 5632), (1, 49152, 2048)):
        p = gemv.plan(rows, n, k, sm90[gemv.config_key(rows)], 132)
        block_k = sm90[gemv.config_key(rows)].block_k
        assert p.k_per_split % block_k == 0 and (p.split_k - 1) * p.k_per_split < k <= p.split_k * p.k_per_split
    assert gemv.plan(3, 64, 64, FMA, 8).block_m == gemv.DOT_ROWS                      # FMA is one row only


def test_hal_registers_the_ops_by_name():
    from hal.cuda import attention

    for name in attention.GEMV_OPS:
        assert callable(attention.fused_op(name, configs_for("sm_90"), 132))
    assert set(gemv_ops.gemv_ops()) == set(attention.GEMV_OPS)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("path", PATHS, ids=list(PATHS))
def test_fp8_weights_stream_and_scale_once(path, fp8):
    """W8A16 (`Gemv.fp8_linear`): FP8 weights widen exactly, the per-channel scale multiplies the
    fp32 sum once (after the split-K partials are summed): the product of the dequantized weight
    rounded once. Operands the kernel does not take answer None (the Hal's GEMM takes them)."""
    from hal.common.kv_quant import quantize

    ops = _ops(PATHS[path])
    weight, scale = quantize(torch.randn(48, 160) * 0.05, fp8)
    dequantized = weight.float() * scale[:, None]
    for rows in _rows_for(PATHS[path]):
        x = torch.randn(rows, 160).bfloat16()
        out = ops.fp8_linear(x, weight, scale)
        _assert_product(out, x.float(), dequantized, f"fp8 {rows} rows")
    assert ops.fp8_linear(torch.randn(9, 160).bfloat16(), weight, scale) is None
    assert ops.fp8_linear(torch.randn(2, 160), weight, scale) is None


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("block_k", [256, 64], ids=["one-slice", "three-slices"])
def test_fp8_slice_with_unit_scales_gives_the_bits_of_its_bf16_values(block_k, fp8, monkeypatch):
    """The slice kernel widens FP8 weights exactly: with unit scales the product is the slice kernel's
    bf16 product of the same values to the bit (K in one slice: plain and SwiGLU; in three: SwiGLU, the
    only 16-bit product split there)."""
    config = KernelConfig(1, 4, 4, 1, block_k=block_k, split_k=3)
    ops = gemv_ops.Gemv({**configs_for("default"), gemv_ops.SLICE_KEY: config}, 16, max_rows=1)
    launched = []
    run = gemv_ops.run_launch
    monkeypatch.setattr(gemv_ops, "run_launch", lambda launch: launched.append(launch.kernel) or run(launch))
    weight = (torch.randn(40, 160) * 4).to(fp8)
    weight[:, :8] = ((torch.arange(8) % 8).float() * 2 ** -10).to(fp8)          # subnormals of both formats
    same = weight.to(torch.bfloat16)
    assert torch.equal(same.float(), weight.float())
    unit, x, gate_up = torch.ones(40), torch.randn(1, 160).bfloat16(), torch.randn(1, 320).bfloat16()
    assert torch.equal(ops.silu_mul_fp8_linear(gate_up, weight, unit), ops.silu_mul_linear(gate_up, same))
    if block_k >= 160:
        assert torch.equal(ops.fp8_linear(x, weight, unit), ops.linear(x, same))
    assert launched and set(launched) == {gemv_slice._slice_gemv_kernel}



def test_one_row_slices_up_to_their_limit_and_leave_counters_zero():
    """The CUDA Hal's default (`max_rows=1`): one row of K in one slice runs the slice kernel, SwiGLU's
    input in up to `split_k` slices (deterministically, counters left zero); more slices or more
    rows take the unfused path, bit for bit."""
    config = KernelConfig(1, 4, 4, 1, block_k=32, split_k=2)
    ops = gemv_ops.Gemv({**configs_for("default"), gemv_ops.SLICE_KEY: config}, 16, max_rows=1)
    x, weight = torch.randn(1, 32).bfloat16(), (torch.randn(12, 32) / 6).bfloat16()
    assert ops._fits(x, weight) and ops.projection_takes(1, 32)
    assert not ops.projection_takes(1, 32, after_norm=True)     # the norm would be a launch of its own
    _assert_product(ops.linear(x, weight), x, weight, "one slice")
    gate_up, down = torch.randn(1, 128).bfloat16(), (torch.randn(12, 64) / 8).bfloat16()   # two slices
    first = ops.silu_mul_linear(gate_up, down)
    assert torch.equal(first, ops.silu_mul_linear(gate_up, down))
    _assert_product(first, silu_and_mul_ref(gate_up), down, "two slices")
    assert not gemv_ops.split_counters(torch.device("cpu")).any()
    x2 = torch.randn(1, 64).bfloat16()
    assert not ops.projection_takes(1, 64) and not ops.projection_takes(1, 96)
    assert torch.equal(ops.linear(x2, down), torch.nn.functional.linear(x2, down))
    rows2 = torch.randn(2, 32).bfloat16()
    assert not ops._fits(rows2, weight) and torch.equal(ops.linear(rows2, weight),
                                                        torch.nn.functional.linear(rows2, weight))


def _one_row_ops_recording(monkeypatch, module, name: str):
    """(one-row ops on 32-wide slices, the launches they run, the calls of `module.name` they make)."""
    config = KernelConfig(1, 4, 4, 1, block_k=32, split_k=2)
    ops = gemv_ops.Gemv({**configs_for("default"), gemv_ops.SLICE_KEY: config}, 16, max_rows=1)
    launched, calls = [], []
    run = gemv_ops.run_launch
    monkeypatch.setattr(gemv_ops, "run_launch", lambda launch: launched.append(launch) or run(launch))
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a) or real(*a, **k))
    return ops, launched, calls


def test_one_row_sandwich_runs_norm_add_norm_then_the_plain_slice(monkeypatch):
    """Where the slice kernel takes a sandwich projection (Ouro's gate|up at batch 1), the boundary runs
    as one norm_add_norm launch and the slice kernel takes its output without a prologue (lever 61:
    faster than recomputing both row norms in every program); the same values as the prologue path."""
    from hal.kernels import norms

    ops, launched, boundaries = _one_row_ops_recording(monkeypatch, norms, "norm_add_norm")
    x, residual = (torch.randn(1, 32) * 3).bfloat16(), torch.randn(1, 32).bfloat16()
    w1, w2, eye = torch.randn(32).bfloat16(), torch.randn(32).bfloat16(), _permutation(32, torch.bfloat16)
    y, h = ops.norm_residual_linear(x, residual, w1, w2, 1e-6, eye)
    assert len(boundaries) == 1 and [launch.kernel for launch in launched] == [gemv_slice._slice_gemv_kernel]
    assert launched[0].kwargs["PROLOGUE"] == gemv.NONE
    h_ref = rms_norm_ref(x, w1, 1e-6, residual)
    _assert_bits(h, h_ref, "stream")
    _assert_bits(y, rms_norm_ref(h_ref, w2, 1e-6) @ eye.T, "sandwich")


def test_one_row_norm_runs_rms_norm_then_the_plain_slice(monkeypatch):
    """`rms_norm_linear` where the slice kernel takes the projection (Ouro's first q|k|v per loop at
    batch 1): the norm as its own launch, the slice kernel without a prologue (lever 61's reason);
    the values of the prologue path, to the bit."""
    from hal.kernels import ops as small_ops

    ops, launched, norms = _one_row_ops_recording(monkeypatch, small_ops, "rms_norm")
    x, w = (torch.randn(1, 32) * 3).bfloat16(), torch.randn(32).bfloat16()
    eye = _permutation(32, torch.bfloat16)
    y = ops.rms_norm_linear(x, w, 1e-6, eye)
    assert len(norms) == 1 and [launch.kernel for launch in launched] == [gemv_slice._slice_gemv_kernel]
    assert launched[0].kwargs["PROLOGUE"] == gemv.NONE
    _assert_bits(y, rms_norm_ref(x, w, 1e-6) @ eye.T, "norm")


class _ClaimingGemm:
    """A product that claims one shape (as the CUDA Hal's TMA ring claims its table's), recording calls."""

    def __init__(self, shape):
        self.shape, self.calls = shape, []

    def prefers(self, x, weight):
        return x.numel() == x.shape[-1] and tuple(weight.shape) == self.shape

    def __call__(self, x, weight):
        self.calls.append(tuple(weight.shape))
        return torch.nn.functional.linear(x, weight)


def test_a_gemm_that_claims_a_plain_one_row_product_gets_it(monkeypatch):
    """Where the unfused product `prefers` a shape (the ring, lever 114), the plain one-row products
    of that shape go to it, the norm before them still in its own launch; a product with a residual
    epilogue or a SwiGLU prologue, and other shapes, stay on the slice kernel."""
    from hal.kernels import norms

    ops, launched, boundaries = _one_row_ops_recording(monkeypatch, norms, "norm_add_norm")
    eye, other = _permutation(32, torch.bfloat16), (torch.randn(16, 32) / 6).bfloat16()
    ops.gemm = claim = _ClaimingGemm((32, 32))
    x, residual = (torch.randn(1, 32) * 3).bfloat16(), torch.randn(1, 32).bfloat16()
    w1, w2 = torch.randn(32).bfloat16(), torch.randn(32).bfloat16()
    assert torch.equal(ops.linear(x, eye), x @ eye.T)
    y, h = ops.norm_residual_linear(x, residual, w1, w2, 1e-6, eye)
    _assert_bits(y, rms_norm_ref(rms_norm_ref(x, w1, 1e-6, residual), w2, 1e-6) @ eye.T, "sandwich")
    y = ops.rms_norm_linear(x, w1, 1e-6, eye)
    _assert_bits(y, rms_norm_ref(x, w1, 1e-6) @ eye.T, "norm")
    assert claim.calls == [(32, 32)] * 3 and launched == [] and len(boundaries) == 1
    ops.linear(x, eye, residual)                                    # the add stays in the slice's epilogue
    ops.linear(x, other)                                            # a shape it does not claim
    ops.silu_mul_linear(torch.randn(1, 64).bfloat16(), eye)         # SwiGLU stays in the slice's prologue
    assert claim.calls == [(32, 32)] * 3
    assert [launch.kernel for launch in launched] == [gemv_slice._slice_gemv_kernel] * 3


def test_fp8_one_row_takes_the_slice_kernel_in_up_to_split_k_slices(monkeypatch):
    """FP8 weights at one row (`fp8_linear`, the CUDA Hal's W8A16 path): K in up to `split_k` slices
    runs the slice kernel (Ouro-1.4B's down projection: 3 slices of 2048), more slices the K-looping
    kernel; both give the dequantized product rounded once, and leave the counters zero."""
    from hal.common.kv_quant import quantize

    config = KernelConfig(1, 4, 4, 1, block_k=32, split_k=3)
    ops = gemv_ops.Gemv({**configs_for("default"), gemv_ops.SLICE_KEY: config}, 16)
    launches = []
    real = gemv_ops.slice_gemv_launch
    monkeypatch.setattr(gemv_ops, "slice_gemv_launch", lambda *a, **kw: launches.append(a[1].shape) or real(*a, **kw))
    for k, sliced in ((96, True), (160, False)):                  # 3 slices; 5 slices
        weight, scale = quantize(torch.randn(12, k) * 0.05, torch.float8_e4m3fn)
        x = torch.randn(1, k).bfloat16()
        out = ops.fp8_linear(x, weight, scale)
        _assert_product(out, x.float(), weight.float() * scale[:, None], f"fp8 K={k}")
        assert torch.equal(out, ops.fp8_linear(x, weight, scale))
        assert (launches[-1:] == [weight.shape]) == sliced, (k, launches)
        launches.clear()
    assert not gemv_ops.split_counters(torch.device("cpu")).any()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("path", PATHS, ids=list(PATHS))
def test_fp8_down_projection_takes_swiglu_in_its_prologue(path, fp8):
    """`silu_mul_fp8_linear`: SwiGLU rounded as silu_and_mul rounds it, then the FP8 product (and the
    residual add) of `fp8_linear`: the dequantized product of that input rounded once, and the
    unfused pair's bits up to the one-ulp moves of silu's exp. Operands `fp8_linear` declines answer None."""
    from hal.common.kv_quant import quantize

    ops = _ops(PATHS[path])
    n, k = 40, 96
    weight, scale = quantize(torch.randn(n, k) * 0.05, fp8)
    dequantized = weight.float() * scale[:, None]
    for rows in _rows_for(PATHS[path]):
        gate_up, residual = (torch.randn(rows, 2 * k) * 2).bfloat16(), torch.randn(rows, n).bfloat16()
        act = silu_and_mul_ref(gate_up)
        unfused = ops.fp8_linear(act, weight, scale)
        for res in (None, residual):
            what = f"{path} rows={rows} residual={res is not None}"
            out = ops.silu_mul_fp8_linear(gate_up, weight, scale, res)
            _assert_product(out, act.float(), dequantized, what, res)
            _assert_bits(out, unfused if res is None else res + unfused, what)
    gate_up = torch.randn(gemv_ops.MAX_ROWS + 1, 2 * k).bfloat16()
    assert ops.silu_mul_fp8_linear(gate_up, weight, scale) is None
    assert ops.silu_mul_fp8_linear(gate_up[:1].float(), weight, scale) is None
    assert ops.silu_mul_fp8_linear(gate_up[:1, :k], weight, scale) is None                 # not gate | up


def test_fp8_swiglu_down_is_one_launch_on_fp8_linears_kernel(monkeypatch):
    """At one row the fused op launches once, on the kernel `fp8_linear` takes for the same K: the
    slice kernel for K in up to `split_k` slices, the K-looping one past that."""
    from hal.common.kv_quant import quantize

    config = KernelConfig(1, 4, 4, 1, block_k=32, split_k=3)
    ops = gemv_ops.Gemv({**configs_for("default"), gemv_ops.SLICE_KEY: config}, 16)
    kernels = []
    real = gemv_ops.run_launch
    monkeypatch.setattr(gemv_ops, "run_launch", lambda launch: kernels.append(launch.kernel) or real(launch))
    for k, kernel in ((96, gemv_slice._slice_gemv_kernel), (160, gemv._gemv_kernel)):   # 3 slices; 5
        weight, scale = quantize(torch.randn(12, k) * 0.05, torch.float8_e4m3fn)
        gate_up, residual = torch.randn(1, 2 * k).bfloat16(), torch.randn(1, 12).bfloat16()
        ops.fp8_linear(silu_and_mul_ref(gate_up), weight, scale)
        assert kernels == [kernel], (k, kernels)
        plain = kernels.pop()
        kernels.clear()
        out = ops.silu_mul_fp8_linear(gate_up, weight, scale, residual)
        assert kernels == [plain], (k, kernels)
        kernels.clear()
        dequantized = weight.float() * scale[:, None]
        _assert_product(out, silu_and_mul_ref(gate_up).float(), dequantized, f"K={k}", residual)
    assert not gemv_ops.split_counters(torch.device("cpu")).any()


class _Fp8Hal:
    """A Hal offering `names` of the ops the CUDA/ROCm Hals build for FP8 weights (as hal/cuda/fp8.py
    builds them for an MI300: W8A16 only), counting the calls by name."""

    def __init__(self, names: tuple[str, ...]):
        from hal.cuda.fp8 import fp8_linear_op, silu_mul_fp8_linear_op
        from hal.kernels.ops import fused_ops

        configs = configs_for("default")
        silu, linear = fused_ops(configs)["silu_and_mul"], fp8_linear_op("gfx942", configs, True)
        table = {"silu_and_mul": silu, "fp8_linear": linear,
                 "silu_mul_fp8_linear": silu_mul_fp8_linear_op("gfx942", configs, linear, silu)}
        self.ops, self.calls = {name: table[name] for name in names}, {}

    def op(self, name):
        fn = self.ops.get(name)
        if fn is None:
            return None

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted


@pytest.mark.parametrize("rows", [1, 9])
def test_swiglu_down_runs_an_fp8_down_projection_as_one_op(rows):
    """SwiGLU.down over an FP8 `down_proj`: one `silu_mul_fp8_linear` call (residual included, no
    silu_and_mul) where the Hal has the op, silu_and_mul and the FP8 linear where it does not; the same
    values (9 rows: the op's own unfused path, bit for bit)."""
    from types import SimpleNamespace

    from zoo.context import ModelOps
    from zoo.fp8 import Fp8Linear
    from zoo.layers import SwiGLU

    mlp = SwiGLU(48, 80).bfloat16()
    mlp.down_proj = Fp8Linear.from_linear(mlp.down_proj, torch.float8_e4m3fn)
    gate_up, residual = (torch.randn(rows, 160) * 2).bfloat16(), torch.randn(rows, 48).bfloat16()
    results = {}
    for fused in (True, False):
        names = ("silu_and_mul", "fp8_linear") + (("silu_mul_fp8_linear",) if fused else ())
        hal = _Fp8Hal(names)
        ops = ModelOps(hal, fused=True)
        mlp.down_proj.ops = ops                                   # the engine binds its Hal (quantize_fp8)
        with torch.inference_mode():
            results[fused] = [mlp.down(gate_up, SimpleNamespace(ops=ops), res) for res in (None, residual)]
        assert hal.calls == ({"silu_mul_fp8_linear": 2} if fused else {"silu_and_mul": 2, "fp8_linear": 2})
    for got, want in zip(results[True], results[False]):
        if rows == 1:
            _assert_bits(got, want, "fused vs unfused")
        else:
            assert torch.equal(got, want)


def test_fp8_swiglu_op_follows_the_fp8_gemm_choice(monkeypatch):
    """A forced FP8 GEMM (`LOOPSTACK_FP8_GEMM`) runs every product, the down projection's too."""
    from hal.cuda.fp8 import GEMM_ENV, silu_mul_fp8_linear_op

    monkeypatch.setenv(GEMM_ENV, "triton")
    assert silu_mul_fp8_linear_op("sm_90", configs_for("default"), lambda *a: None, lambda x: x) is None


def test_fp8_swiglu_op_passes_the_conformance_bound():
    """The Hal conformance check of `silu_mul_fp8_linear` (hal/conformance/quant.py) on the op as the
    CUDA/ROCm Hals build it: one row fused, 37 rows through silu_and_mul and the FP8 tile kernel."""
    from types import SimpleNamespace

    from hal.conformance.quant import _check_silu_mul_fp8_linear

    fp8 = _Fp8Hal(("silu_and_mul", "fp8_linear", "silu_mul_fp8_linear"))
    hal = SimpleNamespace(op=fp8.op, device=lambda: torch.device("cpu"),
                          caps=SimpleNamespace(dtypes=(torch.bfloat16, torch.float32)))
    assert _check_silu_mul_fp8_linear(hal, torch.float8_e4m3fn)
    assert fp8.calls == {"silu_mul_fp8_linear": 8}


def test_unfused_products_run_through_the_injected_gemm():
    """Rows past `max_rows` take the unfused path, whose products go to `gemm` (the CUDA Hal passes
    hal/cuda/blaslt.py's table there): every op calls it once with the tensors F.linear would get."""
    calls = []

    def gemm(x, w):
        calls.append((tuple(x.shape), tuple(w.shape)))
        return torch.nn.functional.linear(x, w)

    ops = gemv_ops.gemv_ops({**configs_for("default"), "gemv": DOT}, num_compute_units=16, max_rows=1, gemm=gemm)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(32, 64, generator=gen, dtype=torch.bfloat16)
    down = torch.randn(64, 32, generator=gen, dtype=torch.bfloat16)
    norm_w = torch.rand(64, generator=gen, dtype=torch.bfloat16) + 0.5
    assert torch.equal(ops["linear"](x, w), torch.nn.functional.linear(x, w))
    ops["rms_norm_linear"](x, norm_w, 1e-6, w)
    ops["silu_mul_linear"](x, down)
    ops["norm_residual_linear"](x, x, norm_w, norm_w, 1e-6, w)
    assert calls == [((4, 64), (32, 64)), ((4, 64), (32, 64)), ((4, 32), (64, 32)), ((4, 64), (32, 64))]


@pytest.mark.parametrize("block_k,prologue", [(256, "none"), (32, "none"), (32, "silu_and_mul")],
                         ids=["one-slice", "three-slices", "three-slices-swiglu"])
def test_w8a8_slice_quantizes_each_slice_of_x_and_sums_fp8_products(block_k, prologue):
    """`A8` (the W8A8 one-row form for the FP8 tensor cores): x's slice quantized to e4m3fn by its own
    absmax, the product of FP8 values exact in fp32, both scales applied once: the float64 reference
    rounded once (the split-K partials in split order)."""
    from hal.common.kv_quant import quantize
    from hal.kernels.launch import run_launch

    config = KernelConfig(1, 16, 4, 1, block_k=block_k)
    weight, scale = quantize(torch.randn(40, 96) * 0.05, torch.float8_e4m3fn)
    swiglu = prologue == "silu_and_mul"
    x = torch.randn(1, 192 if swiglu else 96).bfloat16()
    a = silu_and_mul_ref(x) if swiglu else x
    splits = gemv_slice.num_splits(96, config)
    out = torch.empty(1, 40, dtype=torch.bfloat16)
    run_launch(gemv_slice.slice_gemv_launch(
        x, weight, out, config, "interpreter", prologue=gemv.SILU_AND_MUL if swiglu else gemv.NONE,
        workspace=torch.empty(splits * 40), counters=torch.zeros(4, dtype=torch.int32), weight_scale=scale,
        a8=True))
    ref = w8a8_slices_ref(a, weight, scale, block_k)
    err = (out.double() - ref).abs()
    assert (err <= ref.abs() * 2 ** -8 + 1e-6).all(), f"error {err.max().item():.3g}"
    w8a16 = a.double() @ (weight.double() * scale.double()[:, None]).T
    assert (out.double() - w8a16).abs().max() > 0           # x was quantized: not the W8A16 product
    with pytest.raises(ValueError, match="block_n >= 16"):
        gemv_slice.slice_gemv_launch(x, weight, out, KernelConfig(1, 8, 4, 1, block_k=block_k), "interpreter",
                                     weight_scale=scale, a8=True)


def test_w8a8_entry_routes_one_row_e4m3fn_products(monkeypatch):
    """A table with `gemv_slice_w8a8` runs one-row e4m3fn products (plain and SwiGLU + residual) as
    W8A8 on the slice kernel; e4m3fnuz weights keep W8A16."""
    from hal.common.kv_quant import quantize

    a8 = KernelConfig(1, 16, 4, 1, block_k=32, split_k=4)
    ops = gemv_ops.Gemv({**configs_for("default"), gemv_ops.SLICE_KEY: SLICE, gemv_ops.A8_KEY: a8}, 16)
    seen = []
    real = gemv_ops.slice_gemv_launch
    monkeypatch.setattr(gemv_ops, "slice_gemv_launch", lambda *a, **kw: seen.append(kw.get("a8", False))
                        or real(*a, **kw))
    weight, scale = quantize(torch.randn(40, 96) * 0.05, torch.float8_e4m3fn)
    x, gate_up, residual = torch.randn(1, 96).bfloat16(), torch.randn(1, 192).bfloat16(), torch.randn(1, 40).bfloat16()
    ref = w8a8_slices_ref(x, weight, scale, 32)
    assert ((ops.fp8_linear(x, weight, scale).double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()
    y = ops.silu_mul_fp8_linear(gate_up, weight, scale, residual)
    ref = residual.double() + w8a8_slices_ref(silu_and_mul_ref(gate_up), weight, scale, 32).bfloat16().double()
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-6).all()
    assert seen == [True, True]
    fnuz, fnuz_scale = quantize(torch.randn(40, 96) * 0.05, torch.float8_e4m3fnuz)
    _assert_product(ops.fp8_linear(x, fnuz, fnuz_scale), x.float(), fnuz.float() * fnuz_scale[:, None], "fnuz")
    assert seen[2:] == [False]


@pytest.mark.parametrize("n,k,takes", [(6144, 2048, True), (3072, 10752, True), (5280, 17920, True),
                                       (5280, 24576, True), (5280, 24577, False)],
                         ids=["ouro-qkv", "nanbeige-down", "huginn-down", "48-slices", "49-slices"])
def test_the_sm_90_w8a8_entry_takes_every_family_s_decode_products(n, k, takes):
    """The sm_90 table's W8A8 entry takes an e4m3fn product of one row and of decode batches up to
    MAX_ROWS (lever 122: at 2-8 rows they ran gemv.py's K-looping W8A16 kernel) while K fits in its
    split_k slices of 512: Huginn-0125's down (35 slices) among them (lever 124: at 32 it fell to that
    kernel too). Past MAX_ROWS the fp8 linear leaves the decode GEMV (cuBLASLt's W8A8)."""
    ops = gemv_ops.Gemv(configs_for("sm_90"), 132)
    weight = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")
    for rows in (1, 2, gemv_ops.MAX_ROWS):
        assert (ops._tensor_core_slice(gemv_ops.A8_KEY, weight.shape[1], rows) is not None) == takes, rows
    assert not ops.takes(gemv_ops.MAX_ROWS + 1, k)


def test_the_cuda_hal_s_slices_take_two_rows_where_the_tensor_core_entry_does():
    """With the CUDA Hal's `max_rows` 1 (slices only) the 16-bit projections of a decode step take the slice
    kernels at one row where K is one slice (or SwiGLU's few), and at two rows where the sm_90 tensor-core
    entry (block_m 2, lever 127) takes them too; three rows, and K the slice kernel does not take, stay on
    the library (cuBLAS), as without the entry's rows."""
    sm_90 = configs_for("sm_90")
    ops = gemv_ops.Gemv(sm_90, 132, max_rows=1)
    assert ops.takes(1, 2048) and ops.takes(2, 2048) and ops.takes(2, 5632, gemv.SILU_AND_MUL)
    assert not ops.takes(3, 2048) and not ops.takes(2, 3072) and not ops.takes(1, 3072)
    assert ops.projection_takes(2, 2048, after_norm=True)
    one_row = gemv_ops.Gemv({**sm_90, gemv_ops.TC_KEY: KernelConfig(1, 128, 4, 1, block_k=256, split_k=32)}, 132,
                            max_rows=1)
    assert one_row.takes(1, 2048) and not one_row.takes(2, 2048)
    assert gemv_ops.Gemv(sm_90, 132).takes(3, 3072)          # max_rows 8 (LOOPSTACK_DECODE_PROJECTIONS=1): every K


@pytest.mark.parametrize("num_rows,prologue", [(3, "none"), (8, "silu_and_mul"), (16, "none")])
def test_w8a8_slice_takes_several_rows_each_quantized_on_its_own(num_rows, prologue):
    """The tensor-core forms take up to 16 rows (the rows are the dot's columns): each row's slice of x
    quantized by its own absmax, split-K partials per row, the residual added per row; a row of zeros
    stays zeros; 17 rows are refused."""
    from hal.common.kv_quant import quantize
    from hal.kernels.launch import run_launch

    config = KernelConfig(16, 16, 4, 1, block_k=32)
    weight, scale = quantize(torch.randn(40, 96) * 0.05, torch.float8_e4m3fn)
    swiglu = prologue == "silu_and_mul"
    x = torch.randn(num_rows, 192 if swiglu else 96).bfloat16() * torch.logspace(-2, 1, num_rows)[:, None].bfloat16()
    x[1] = 0
    a = silu_and_mul_ref(x) if swiglu else x
    residual = torch.randn(num_rows, 40).bfloat16()
    splits = gemv_slice.num_splits(96, config)
    out = torch.empty(num_rows, 40, dtype=torch.bfloat16)
    run_launch(gemv_slice.slice_gemv_launch(
        x, weight, out, config, "interpreter", prologue=gemv.SILU_AND_MUL if swiglu else gemv.NONE,
        out_residual=residual, workspace=torch.empty(splits * num_rows * 40), counters=torch.zeros(4, dtype=torch.int32),
        weight_scale=scale, a8=True))
    ref = residual.double() + w8a8_slices_ref(a, weight, scale, 32).bfloat16().double()
    err = (out.double() - ref).abs()
    assert (err <= ref.abs() * 2 ** -7 + 1e-6).all(), f"error {err.max().item():.3g}"
    assert torch.equal(out[1], residual[1])
    with pytest.raises(ValueError, match="up to 16 on the tensor cores"):
        gemv_slice.slice_gemv_launch(torch.zeros(17, 96).bfloat16(), weight, torch.empty(17, 40).bfloat16(), config,
                                     "interpreter", weight_scale=scale, a8=True)
    with pytest.raises(ValueError, match="takes one row"):
        gemv_slice.slice_gemv_launch(x, weight.float().bfloat16(), out, config, "interpreter")


def test_entries_with_block_m_take_decode_batches_up_to_it(monkeypatch):
    """`gemv_slice_w8a8` / `gemv_slice_tc` with block_m 16 run e4m3fn / 16-bit products of 2-8 rows on the
    slice kernel (the table's block_m 1 entries only one row): the W8A8 rows as the per-row reference,
    the 16-bit rows as the exact product."""
    from hal.common.kv_quant import quantize

    a8, tc = KernelConfig(16, 16, 4, 1, block_k=32, split_k=4), KernelConfig(16, 16, 4, 1, block_k=32, split_k=8)
    ops = gemv_ops.Gemv({**configs_for("default"), gemv_ops.SLICE_KEY: SLICE, gemv_ops.A8_KEY: a8,
                         gemv_ops.TC_KEY: tc}, 16)
    seen = []
    real = gemv_ops.slice_gemv_launch
    monkeypatch.setattr(gemv_ops, "slice_gemv_launch", lambda *a, **kw: seen.append(
        (a[0].shape[0], kw.get("a8", False), kw.get("tensor_cores", False))) or real(*a, **kw))
    weight, scale = quantize(torch.randn(40, 96) * 0.05, torch.float8_e4m3fn)
    x = torch.randn(5, 96).bfloat16()
    ref = w8a8_slices_ref(x, weight, scale, 32)
    assert ((ops.fp8_linear(x, weight, scale).double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-6).all()
    w16 = (torch.randn(40, 96) / 8).bfloat16()
    _assert_product(ops.linear(x, w16), x.float(), w16.float(), "tc rows")
    assert seen == [(5, True, False), (5, False, True)]
    one_row = gemv_ops.Gemv({**configs_for("default"), gemv_ops.SLICE_KEY: SLICE,
                             gemv_ops.A8_KEY: KernelConfig(1, 16, 4, 1, block_k=32, split_k=4)}, 16)
    seen.clear()
    one_row.fp8_linear(x, weight, scale)
    assert seen == []                                    # block_m 1: five rows keep the W8A16 GEMV


@pytest.mark.parametrize("block_k", [256, 32], ids=["one-slice", "three-slices"])
def test_tensor_core_slice_rounds_the_product_once(block_k):
    """`TC` (16-bit weights on the tensor cores, x as column 0 of the dot's second operand): the exact
    products summed in fp32, rounded once (with and without split-K); fp8 weights are refused."""
    from hal.kernels.launch import run_launch

    config = KernelConfig(1, 16, 4, 1, block_k=block_k)
    weight, x = (torch.randn(40, 96) / 8).bfloat16(), torch.randn(1, 96).bfloat16()
    splits = gemv_slice.num_splits(96, config)
    out = torch.empty(1, 40, dtype=torch.bfloat16)
    run_launch(gemv_slice.slice_gemv_launch(x, weight, out, config, "interpreter", workspace=torch.empty(splits * 40),
                                            counters=torch.zeros(4, dtype=torch.int32), tensor_cores=True))
    _assert_product(out, x.float(), weight.float(), f"{splits} slices")
    with pytest.raises(ValueError, match="weight of x's dtype"):
        gemv_slice.slice_gemv_launch(x, weight.to(torch.float8_e4m3fn), out, config, "interpreter",
                                     weight_scale=torch.ones(40), tensor_cores=True)


def test_tensor_core_entry_takes_the_slice_kernels_16_bit_products(monkeypatch):
    """A table with `gemv_slice_tc` runs the one-row 16-bit products the slice kernel takes (plain, and
    SwiGLU with the residual add) on the tensor cores; FP8 weights keep their W8A16 slice."""
    from hal.common.kv_quant import quantize

    tc = KernelConfig(1, 16, 4, 1, block_k=32, split_k=8)
    ops = gemv_ops.Gemv({**configs_for("default"), gemv_ops.SLICE_KEY: SLICE, gemv_ops.TC_KEY: tc}, 16, max_rows=1)
    seen = []
    real = gemv_ops.slice_gemv_launch
    monkeypatch.setattr(gemv_ops, "slice_gemv_launch", lambda *a, **kw: seen.append(kw.get("tensor_cores", False))
                        or real(*a, **kw))
    weight, x = (torch.randn(40, 96) / 8).bfloat16(), torch.randn(1, 96).bfloat16()
    _assert_product(ops.linear(x, weight), x.float(), weight.float(), "plain")
    gate_up, residual = torch.randn(1, 192).bfloat16(), torch.randn(1, 40).bfloat16()
    _assert_product(ops.silu_mul_linear(gate_up, weight, residual), silu_and_mul_ref(gate_up).float(), weight.float(),
                    "swiglu", residual)
    fp8, scale = quantize(torch.randn(40, 96) * 0.05, torch.float8_e4m3fn)
    _assert_product(ops.fp8_linear(x, fp8, scale), x.float(), fp8.float() * scale[:, None], "fp8")
    assert seen == [True, True, False]
