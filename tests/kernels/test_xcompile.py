"""Cross-compile checks: every kernel in every config a Hal can choose compiles for gfx942, gfx950
and sm_90 (the arch tables also for sm_80) without spills or scratch, within LDS/shared limits, with
MFMA / wgmma where expected. All compile-heavy tests live in this module; compiles are cached for the
session (`xcompile.compile_case`)."""
from __future__ import annotations

import pytest
from xcompile_report import add_rows

import xcompile
from hal.kernels.configs import KernelConfig, all_configs

PAIRS = [(table, target) for table in all_configs() for target in xcompile.TABLE_TARGETS[table]]


@pytest.fixture
def reports(request, record_property):
    """Where a test's reports go: the terminal summary's table (with -rA or -v) and junit."""
    def add(rows: list[xcompile.Report], name: str) -> None:
        add_rows(request.config, xcompile.format_rows(rows))
        record_property(name, xcompile.format_table(rows))
    return add


@pytest.mark.parametrize("table,target", PAIRS, ids=[f"{t}-on-{g}" for t, g in PAIRS])
def test_tables_compile_clean(table, target, reports):
    rows = xcompile.check_all({table: all_configs()[table]}, (target,))
    reports(rows, "xcompile")
    assert len(rows) == sum(c.config_key in all_configs()[table] for c in xcompile.CASES.values())
    problems = [f"{r.case}: {'; '.join(r.problems)}" for r in rows if r.problems]
    assert not problems, f"{table} on {target}:\n" + "\n".join(problems)
    for r in rows:
        if xcompile.CASES[r.case].has_dot:
            expected = "v_mfma" if target.startswith("gfx") else ("wgmma", "mma.sync")
            assert r.mma.startswith(expected), f"{r.case} on {target}: {r.mma}"
        if r.case.startswith("attention") and r.case != "attention_reduce":
            assert r.vec16, f"{r.case} on {target}: K/V loads are not 16-byte vectors"
        if r.case.startswith("gemv"):
            assert r.vec16, f"{r.case} on {target}: weight loads are not 16-byte vectors"


@pytest.mark.parametrize("target,num_cases", [("gfx942", 11), ("gfx950", 11), ("sm_90", 20)])
def test_fp8_kernels_compile_clean(target, num_cases, reports):
    """Attention over an FP8 KV cache, the quantizing KV writes (alone and with rotary), the W8A16
    linear and decode GEMV, the activation quantizations and (sm_90) the W8A8 tile, each in the target's
    own format (e4m3fnuz on gfx942, e4m3fn on gfx950 and sm_90), in its arch table. (sm_90 since the
    fifty-third session, whose prefill tile over an FP8 cache had spilled unseen: 10 s more.)"""
    rows = xcompile.check_fp8((target,))
    reports(rows, "xcompile_fp8")
    fmt = "e4m3fnuz" if target == "gfx942" else "e4m3fn"
    assert len(rows) == num_cases and all(r.case.endswith(fmt) for r in rows), [r.case for r in rows]
    assert f"rotary_kv_write/{fmt}" in {r.case for r in rows}
    problems = [f"{r.case}: {'; '.join(r.problems)}" for r in rows if r.problems]
    assert not problems, f"FP8 on {target}:\n" + "\n".join(problems)
    for r in rows:
        if xcompile.FP8_CASES[r.case].has_dot:
            assert r.mma.startswith("v_mfma" if target.startswith("gfx") else ("wgmma", "mma.sync")), r


def test_sm90_prefill_uses_wgmma_and_decode_fits_several_programs_per_sm():
    prefill = xcompile.compile_case("attention_prefill", all_configs()["sm_90"]["attention_prefill"], "sm_90")
    decode_config = all_configs()["sm_90"]["attention_decode"]
    decode = xcompile.compile_case("attention_decode/batch", decode_config, "sm_90")
    assert prefill.mma == "wgmma"
    assert decode.occupancy >= 2, decode


def test_sm90_fp8_row_decode_streams_without_spills():
    """The row-stream kernel the H200 table routes FP8 multi-head decode to: 16-byte cp.async loads,
    no spills, at least 3 programs per SM (the occupancy its measured speed came from)."""
    config = all_configs()["sm_90"]["attention_row_decode_fp8"]
    report = xcompile.compile_case("attention_row_decode/batch-e4m3fn", config, "sm_90")
    assert not report.problems and report.vec16 and report.shared > 0, report    # shared: K/V are pipelined
    assert report.occupancy >= 3, report


def test_sm90_fp8_prefill_tile_fits_two_programs_per_sm():
    """The sm_90 prefill tile over an FP8 cache (lever 130) is 64 query rows on 4 warps, two programs per SM (the
    128-row tile it replaced ran one, and spilled: `test_fp8_kernels_compile_clean` checks spills)."""
    config = all_configs()["sm_90"]["attention_prefill_fp8"]
    report = xcompile.compile_case("attention_prefill/e4m3fn", config, "sm_90")
    assert report.mma == "wgmma" and report.occupancy >= 2, report


def test_w8a8_tile_candidate_compiles_clean_for_sm_90():
    """Lever 137's `fp8_linear_w8a8` candidate (whole K; the table's splits it): W8A8 on wgmma, no spills, at
    Ouro-1.4B's down projection on 128 quantized rows."""
    from hal.kernels.configs import W8A8_TILE_CANDIDATE

    report = xcompile.compile_case("fp8_linear_w8a8/e4m3fn", W8A8_TILE_CANDIDATE, "sm_90")
    assert report.mma == "wgmma" and not report.problems, report


def test_w8a8_split_candidate_compiles_clean_for_sm_90():
    """Lever 139's candidate, the sm_90 table's entry: the same tile with K split in two at that shape (the
    last split's sum of the fp32 partials in the epilogue), PDL: still wgmma, no spills."""
    from hal.kernels.configs import W8A8_SPLIT_CANDIDATE

    report = xcompile.compile_case("fp8_linear_w8a8/e4m3fn", W8A8_SPLIT_CANDIDATE, "sm_90")
    assert report.mma == "wgmma" and not report.problems, report


def test_w8a8_deep_candidate_compiles_clean_for_sm_90():
    """Lever 140's candidate (256 of K a step, 3 stages; not in a table yet): wgmma, no spills, two programs
    an SM at least (its rule assumes two)."""
    from hal.kernels.configs import W8A8_DEEP_CANDIDATE

    report = xcompile.compile_case("fp8_linear_w8a8/e4m3fn", W8A8_DEEP_CANDIDATE, "sm_90")
    assert report.mma == "wgmma" and not report.problems and report.occupancy >= 2, report


def test_oversized_tile_is_flagged():
    """A 256x128 prefill tile on 4 waves cannot fit gfx942's 512 VGPRs: the check must say so.
    (256x256 spills too, but takes 25 s of CPU to compile; this one 6 s.)"""
    report = xcompile.compile_case("attention_prefill", KernelConfig(256, 128, 4, 1, matrix_instr_nonkdim=16),
                                   "gfx942")
    assert report.problems, report
    assert any("spill" in p or "scratch" in p for p in report.problems), report.problems


def test_loss_of_matrix_instructions_is_flagged():
    case = xcompile.CASES["attention_prefill"]
    config = all_configs()["sm_90"]["attention_prefill"]
    clean = {"spill": 0, "scratch": 0, "shared": 1024}
    assert xcompile._problems(case, "gfx942", config, {**clean, "mma": "-"}) == ("no MFMA for tl.dot",)
    assert xcompile._problems(case, "sm_90", config, {**clean, "mma": "mma.sync"}) == \
        ("no wgmma in the large-tile config",)
    assert xcompile._problems(case, "gfx950", config, {**clean, "shared": 200 * 1024, "mma": "v_mfma_x"}) == \
        (f"shared/LDS {200 * 1024} > {160 * 1024} bytes",)


def test_cli_prints_the_table(capsys):
    assert xcompile.main(["--tables", "default", "--targets", "gfx942", "--fp8"]) == 0
    out = capsys.readouterr().out
    assert "attention_decode/split" in out and "v_mfma" in out and "0 with problems" in out
    assert "kv_write/e4m3fnuz" in out


PDL_CASES = ("gemv_m1/qkv-rms", "gemv_m1/down-silu-res", "attention_decode/split", "rotary/neox",
             "attention_reduce", "rotary_kv_write/neox", "rms_norm/residual", "kv_write",
             # the W8A8 products' inputs (lever 141: the tile after them launches as they start)
             "fp8_quantize_rows/e4m3fn", "fp8_silu_mul_quantize_rows/e4m3fn", "fp8_norm_add_norm_quantize/e4m3fn")


@pytest.mark.parametrize("case_name", PDL_CASES)
def test_sm90_kernels_compile_with_programmatic_dependent_launch(case_name):
    """With PDL on (hal/kernels/pdl.py) each kernel of a decode step lets the next launch and waits
    for the one before: both grid dependency instructions are in its PTX for sm_90."""
    case = {**xcompile.CASES, **xcompile.FP8_CASES}[case_name]
    launch = case.build(all_configs()["sm_90"][case.config_key], "cuda")
    launch = launch._replace(kwargs={**launch.kwargs, "PDL": True, "launch_pdl": True})
    ptx = xcompile.compile_launch(launch, xcompile.TARGETS["sm_90"]).asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


@pytest.mark.parametrize("case_name", ["rotary/neox", "rotary_kv_write/neox", "rotary_kv_write/keep-kv",
                                       "attention_row_decode/rotary", "attention_row_decode_split/grouped"])
def test_sm90_rotary_rounds_every_product_as_written(case_name):
    """The standalone rotary kernels and the row kernel's fused rotary must store the same bytes, so
    both compile without contraction (`launch.EXACT_ROUNDING`): no product and difference of the NeoX
    rotation may become one `fma` (with it, a quarter of the keys differed by an ulp on the H200)."""
    case = xcompile.CASES[case_name]
    ptx = xcompile.compile_launch(case.build(all_configs()["sm_90"][case.config_key], "cuda"),
                                  xcompile.TARGETS["sm_90"]).asm["ptx"]
    assert "fma.rn.bf16" not in ptx and "fma.rn.f32" not in ptx
    assert "mul.rn.bf16" in ptx
