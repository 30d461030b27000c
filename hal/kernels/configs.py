"""Launch parameters of every kernel in hal/kernels, per GPU architecture.

The Hal picks the table for its device (`configs_for(caps.arch)`) and hands it to the kernels'
callers; nothing else chooses tiles. Keys of a table are kernel names:

  attention_prefill   paged attention for batches with long query runs (prefill, chunked prefill):
                      block_m = query rows (tokens x query heads of one KV head) per program,
                      block_n = keys per inner step
  attention_decode    the same kernel for decode-like batches (every sequence <= a few new tokens),
                      with the context split over several programs (flash-decoding)
  attention_*_fp32    the same for float32 caches (golden and conformance runs, not speed): fp32 tiles
                      take twice the registers and shared memory, and on NVIDIA the products run as
                      3xTF32 (fp32-level error), which needs more registers still
  attention_prefill_fp8  attention_prefill for 16-bit queries over an FP8 KV cache (hal/common/kv_quant.py): the
                      K/V tiles widen from FP8 in registers, which the largest AMD tiles cannot spare
  attention_decode_fp8  attention_decode over an FP8 KV cache: the FP8 V tile reaches the tensor cores
                      through byte-wise shared-memory reads (no transposing load for 8-bit data) and the
                      widened tiles take ~200 registers, so wider key tiles pay (H200,
                      tools/fp8_kernels_bench.py, 128 x 1K, per layer-plane, 2026-12-02: 128 keys x 2
                      stages 317-334 us, x 3 stages 381 us, 64 keys 450 us, 32 keys 414 us)
  attention_decode_tma, attention_decode_tma_fp8  (optional, sm_90) grouped-query decode past a few
                      sequences over a 16-bit / FP8 cache on hal/kernels/gqa_decode.py (TMA page copies):
                      block_n = one or two pages per step, split_k = context splits (0: about 8 programs
                      per SM); a table without them leaves those batches to attention_decode(_fp8)
  attention_row_decode, attention_row_decode_fp8  (optional) the row-stream kernel for multi-head decode
                      (hal/kernels/row_decode.py), 16-bit / FP8 cache: block_n = keys per tile, one
                      softmax stream per tile row; num_stages = cp.async stages of the K/V tiles
  attention_row_decode_split, attention_row_decode_split_fp8  (optional) attention_row_decode(_fp8)
                      where the context splits into at least attend.SPLIT_ROW_MIN_SPLITS parts (a sequence
                      or two: hal/kernels/splits.py), when the latency of a short tile walk matters more
                      than the copy rate; without them those batches take the whole-batch entry too
  attention_row_decode_split_few, attention_row_decode_split_few_fp8  (optional) the same where the
                      context splits 2 to SPLIT_ROW_MIN_SPLITS - 1 ways (batch 1 of many query heads:
                      Huginn, Nanbeige; a few sequences of Ouro); else the whole-batch entry
  attention_row_decode_dense, attention_row_decode_dense_fp8  (optional) attention_row_decode(_fp8)
                      where a batch has at least attend.DENSE_ROW_MIN_PROGRAMS programs per compute unit
  attention_reduce    merges the context splits of attention_decode (num_warps only)
  kv_write            scatter of new K/V rows into the paged cache: block_m tokens per program
  rms_norm, rotary    one row / one token per program (num_warps only)
  norm_add_norm       (optional) a sublayer boundary's residual add and norms in one launch
                      (hal/kernels/ops.py), one row per program; a table without it launches the
                      kernel with its rms_norm entry
  silu_and_mul        block_n = columns per program
  silu_mul_quantize_rows  (optional) SwiGLU and the per-row FP8 quantization of a prompt's down projection
                      input in one launch (hal/kernels/fp8_rows.py): one row per program, num_warps only;
                      a table without it launches the kernel with its rms_norm entry
  fp8_linear          W8A16 linear (FP8 weights, hal/kernels/fp8_linear.py): block_m x block_n output tile
  fp8_linear_w8a8     (optional, sm_90) the same kernel on rows quantized per row (W8A8: FP8 x FP8 on the
                      tensor cores) for products of at most `hal.cuda.fp8.W8A8_TILE_MAX_ROWS` rows, which
                      `torch._scaled_mm` takes otherwise (levers 134, 137 and 139)
  fp8_linear_w8a8_deep  (optional) the W8A8 tile for products whose tiles all fit at about two programs
                      per SM (`fp8_linear.DEEP_MAX_TILES_PER_UNIT`): a longer K step, fewer stages (lever 140)
  gemv_m1, gemv       decode projections (hal/kernels/gemv.py) of one row / of 2..8 rows: block_n output
                      columns and block_k of K per step; block_m 1 = fp32 FMAs (one row only), 16 =
                      tl.dot on rows padded to 16; split_k splits K (0: enough programs for every SM)
  gemv_slice          (optional) one-row projections holding their whole weight slice before waiting on
                      the kernel before (hal/kernels/gemv_slice.py, with PDL): block_n columns x block_k
                      (a power of two) of K per program; K in one slice, or for the down projection (a
                      SwiGLU prologue) in up to split_k slices; a CUDA table with it runs batch-1
                      projections of those shapes there (hal/kernels/gemv_ops.py), the rest on cuBLAS
  gemv_slice_w8a8     (optional, sm_90) e4m3fn products of up to block_m rows (1, or up to 16: a decode
                      batch) as W8A8 on the slice kernel: x quantized per row and block_k slice, wgmma on
                      the FP8 tensor cores (block_n >= 64 for wgmma; K in up to split_k slices; lever 118)
  gemv_slice_tc       (optional, sm_90) the 16-bit products gemv_slice takes (K in one slice; SwiGLU's in
                      up to its split_k), of up to block_m rows, on the tensor cores: the slice staged in
                      shared memory before the PDL wait (lever 119)

`LOOPSTACK_KERNEL_CONFIGS` replaces entries, and removes an optional one given as null
(`'{"gemv_slice_w8a8": null}'`: the W8A16 slice kernel again, for an A/B on one tree).

AMD-only keys (`waves_per_eu`, `matrix_instr_nonkdim`, `kpack`) are passed to a launch only when
it targets an AMD GPU (see `hal.kernels.launch`). On AMD `num_stages` 2 enables the stream
pipeliner (LDS double buffering); NVIDIA uses 2-4 cp.async stages. Every entry is cross-compiled
for its targets on the CPU (`python tools/xcompile.py`): no spills, no scratch, LDS/shared
within the limit, MFMA/wgmma present where expected. None of it has been timed on AMD hardware.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

KERNEL_NAMES = ("attention_prefill", "attention_decode", "attention_prefill_fp32", "attention_decode_fp32",
                "attention_prefill_fp8", "attention_decode_fp8", "attention_row_decode",
                "attention_row_decode_fp8", "attention_row_decode_split", "attention_row_decode_split_fp8",
                "attention_row_decode_split_few", "attention_row_decode_split_few_fp8", "attention_row_decode_dense",
                "attention_row_decode_dense_fp8", "attention_decode_tma",
                "attention_decode_tma_fp8",
                "attention_reduce", "kv_write",
                "rms_norm", "norm_add_norm", "rotary", "silu_and_mul", "fp8_linear", "gemv_m1", "gemv",
                "gemv_slice", "gemv_slice_w8a8", "gemv_slice_tc", "gemv_wide",
                "silu_mul_quantize_rows", "fp8_linear_w8a8", "fp8_linear_w8a8_deep")
# a table without the attention_row_* keys routes every decode batch to the unified kernel
# (hal/kernels/attend.py); one without norm_add_norm launches it with the rms_norm entry; one without
# gemv_wide leaves decode batches above gemv_ops.MAX_ROWS rows to the vendor's GEMM
OPTIONAL_KERNEL_NAMES = ("attention_row_decode", "attention_row_decode_fp8", "attention_row_decode_split",
                         "attention_row_decode_split_fp8", "attention_row_decode_split_few",
                         "attention_row_decode_split_few_fp8", "attention_row_decode_dense",
                         "attention_row_decode_dense_fp8", "attention_decode_tma", "attention_decode_tma_fp8",
                         "norm_add_norm",
                         "gemv_slice", "gemv_slice_w8a8", "gemv_slice_tc", "gemv_wide",
                         "silu_mul_quantize_rows", "fp8_linear_w8a8", "fp8_linear_w8a8_deep")


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of one kernel on one arch."""

    block_m: int                   # query rows per program (attention); rows per program (others)
    block_n: int                   # keys per inner iteration (attention); columns per program (others)
    num_warps: int                 # warps of 32 (NVIDIA) or wavefronts of 64 (AMD CDNA) per program
    num_stages: int
    waves_per_eu: int = 0          # AMD only (0 = compiler default)
    matrix_instr_nonkdim: int = 0  # AMD MFMA tile, 16 or 32 (0 = default)
    kpack: int = 1                 # AMD only (must be 1 on gfx950)
    block_k: int = 0               # reduction elements per step (gemv; 0 = unused)
    split_k: int = 1               # programs sharing one output tile's K (gemv; 0 = auto)
    heads_first: int = 0           # attention: 1 = grid (heads, query blocks, splits), a block's heads side by side

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name}={value} must be a power of two")
        if self.block_k & (self.block_k - 1) or self.split_k < 0:
            raise ValueError(f"KernelConfig.block_k={self.block_k} must be a power of two (or 0), "
                             f"split_k={self.split_k} >= 0")
        if self.heads_first not in (0, 1):
            raise ValueError(f"KernelConfig.heads_first={self.heads_first} must be 0 or 1")
        if self.matrix_instr_nonkdim not in (0, 16, 32):
            raise ValueError(f"matrix_instr_nonkdim={self.matrix_instr_nonkdim} must be 0, 16 or 32")


def _small_ops(num_warps: int, num_stages: int, block_n: int = 1024, **amd: int) -> dict[str, KernelConfig]:
    # silu_and_mul: block_n / (num_warps * warp size) = 8 bf16 per thread = one 16-byte load
    # fp8_linear: 16 rows (decode batches; the least tl.dot takes), 64 columns, K in steps of 64
    return {
        "attention_reduce": KernelConfig(1, 1, num_warps, 1, **amd),
        "kv_write": KernelConfig(1, 1, num_warps, 1, **amd),
        "rms_norm": KernelConfig(1, 1, num_warps, 1, **amd),
        "norm_add_norm": KernelConfig(1, 1, num_warps, 1, **amd),
        "rotary": KernelConfig(1, 1, num_warps, 1, **amd),
        "silu_and_mul": KernelConfig(1, block_n, num_warps, num_stages, **amd),
        "fp8_linear": KernelConfig(16, 64, num_warps, max(num_stages, 2), **amd),
    }


def _gemv(m1: KernelConfig, rows: KernelConfig) -> dict[str, KernelConfig]:
    return {"gemv_m1": m1, "gemv": rows}


def _fp32_attention(prefill: KernelConfig, decode: KernelConfig) -> dict[str, KernelConfig]:
    return {"attention_prefill_fp32": prefill, "attention_decode_fp32": decode}


def _cdna3() -> dict[str, KernelConfig]:
    """MI300X (gfx942) and MI350X (gfx950) take the same tiles (the same VGPR file); a new dict each."""
    return {
        "attention_prefill": KernelConfig(128, 64, 8, 2, waves_per_eu=2, matrix_instr_nonkdim=16),
        "attention_decode": KernelConfig(16, 32, 4, 2, matrix_instr_nonkdim=16),
        "attention_prefill_fp8": KernelConfig(128, 32, 8, 1, waves_per_eu=2, matrix_instr_nonkdim=16),
        "attention_decode_fp8": KernelConfig(16, 32, 4, 2, matrix_instr_nonkdim=16),
        **_fp32_attention(KernelConfig(64, 32, 4, 1), KernelConfig(16, 32, 4, 1)),
        **_small_ops(4, 1, block_n=2048),
        **_gemv(KernelConfig(1, 16, 4, 2, block_k=256, split_k=0),
                KernelConfig(16, 32, 4, 2, block_k=128, split_k=0, matrix_instr_nonkdim=16)),
    }


W8A8_TILE_CANDIDATE = KernelConfig(64, 64, 4, 4, block_k=128)     # lever 137's `fp8_linear_w8a8` (sm_90)
# lever 139's: the same tile, K split where its tiles leave SMs idle and each split keeps 1,536 of K (of
# Ouro-1.4B's products only down splits, in two)
W8A8_SPLIT_CANDIDATE = KernelConfig(64, 64, 4, 4, block_k=128, split_k=0)
# lever 140's `fp8_linear_w8a8_deep`: 256 of K a step in 3 stages (96 KiB of FP8 tiles, two programs an SM),
# for the products whose tiles fit at two an SM (H100 probe, 58th session: q|k|v, o and down at 64 and 128
# rows, gate|up at 64; at 128 rows gate|up's 352 tiles took 16.6 us against the entry above's 12.6)
W8A8_DEEP_CANDIDATE = KernelConfig(64, 64, 4, 3, block_k=256, split_k=0)

_TABLES: dict[str, dict[str, KernelConfig]] = {
    # H100/H200: 8 warps = two warpgroups for wgmma on 128 query rows. Decode: 64-key tiles, 2 stages
    # (one K/V tile in flight beside the one in use, 32 KiB) at 4 programs per SM: 89% / 92% of the copy
    # rate at 64 / 128 x 1K (tools/fp8_kernels_bench.py, 2026-12-02; 3 stages 84% / 88%, 3 programs per SM).
    "sm_90": {
        "attention_prefill": KernelConfig(128, 64, 8, 3),
        # decode runs a sequence's heads side by side (heads_first: they read the same cache rows):
        # 128 x 1K 293 -> 259 us per layer-plane on shuffled pages, the b64 / b128 cells 19.62 / 32.85 ->
        # 19.39 / 32.53 ms (the engine's pages are mostly consecutive; 2026-12-02, fifth session)
        "attention_decode": KernelConfig(16, 64, 4, 2, heads_first=1),
        # prompts over an FP8 cache in 64-row query blocks: 256 programs for a 1,024-token prompt's 16 heads,
        # two per SM (128 x 64 x 8 warps spilled 32 bytes in the FP8 variant, one program per SM). Ouro-1.4B
        # FP8 KV, time to first token: 1,024 tokens 23.79 / 23.48 -> 22.96 / 22.82 ms, 128 tokens 8.94 / 8.57
        # -> 8.19 / 8.28, a 16K prompt 813 -> 754 ms (H100, 2026-12-07, fifty-third session, lever 130);
        # the bf16 kernel lost with the same tile (21.04 -> 21.85 ms at 1,024 tokens)
        "attention_prefill_fp8": KernelConfig(64, 64, 4, 3),
        # a prompt's FP8 down projection input (5,632 values a row at Ouro-1.4B): 4 warps took 8.6 us a row
        # block at 128 rows, about silu_and_mul's and quantize_rows' time together (H100, fifty-fourth
        # session, lever 133)
        "silu_mul_quantize_rows": KernelConfig(1, 1, 16, 1),
        # products of up to 128 quantized rows (a prompt's; a decode batch's past 8 rows) on the W8A8 tile
        # (lever 139): 64 x 64 tiles, 4 warps, 4 stages, 128 of K a step, K split where the tiles leave SMs
        # idle and each split keeps 1,536 of K (of Ouro-1.4B's products only down, in two), PDL with the first
        # weight tile loaded before the wait. Ouro-1.4B FP8 weights + KV against `_scaled_mm` (H100, 58th
        # session, two runs each, alternating): a 128-token prompt's first token 8.05 / 8.28 -> 7.33 / 7.45 ms
        # (bf16 7.91), batch 64 16.08 / 16.04 -> 14.90 / 14.93 ms a step; batch 1 and 1,024-token prompts
        # do not run it. A/B: LOOPSTACK_KERNEL_CONFIGS='{"fp8_linear_w8a8": null}' (`_scaled_mm` again)
        "fp8_linear_w8a8": W8A8_SPLIT_CANDIDATE,
        # FP8 decode where the row kernel does not take it: grouped queries past a few sequences
        # (Nanbeige). 32 keys x 4 warps x 3 stages, Nanbeige4.2-3B FP8 KV 64 x 1K 8.751 -> 8.302 ms (the
        # 128-key 2-stage entry before spilled 16 bytes; 64 keys x 4 x 2 9.878, 128 x 8 x 2 10.227,
        # 32 x 2 x 4 9.139; bf16 8.072: 2026-12-03, twentieth session, docs/performance.md lever 83)
        "attention_decode_fp8": KernelConfig(16, 32, 4, 3),
        # ... which these batches now leave to the TMA kernel (hal/kernels/gqa_decode.py): two pages per
        # step, one warp, 3 stages, splits for ~8 programs per SM. Per layer-plane at Nanbeige's 64 x 1K
        # (tools/gqa_tma_probe.py in b8a5b93): 55.5 us against 82.3 for the entry above, bf16 74.7; in the
        # engine FP8 KV 64 x 1K 8.27 -> 7.26 ms, 128 x 1K 12.11 -> 9.80 (bf16 8.07 / 11.66; at 128 x 1K
        # two splits 10.04, two warps 13.27: 2026-12-04, twenty-second session, lever 86)
        "attention_decode_tma_fp8": KernelConfig(16, 32, 1, 3, split_k=0),
        # the same kernel over the 16-bit cache (slot-major pages): one page x 1 warp x 3 stages, Nanbeige
        # bf16 64 x 1K 7.959-7.974 -> 7.887 / 7.904 ms, 128 x 1K 11.390 -> 10.982 against the unified entry
        # above (two pages x 1 warp x 2 stages 7.916 / 7.918 and 11.004; x 3 stages 8.227: 2026-12-04)
        "attention_decode_tma": KernelConfig(16, 16, 1, 3, split_k=0),
        # multi-head decode: the row-stream kernel (hal/kernels/row_decode.py), picked by
        # tools/pick_decode_configs.py from a `gpu_check.sh rowtune` sweep (2026-12-02, tenth session,
        # levers 43-44: the lazy rescale, and tiles reading their own pages beyond two stages). Per
        # layer-plane at 64 / 128 x 1K: FP8 8 keys x 1 warp x 4 stages (3 tiles in flight, 18 programs
        # per SM) 79.6 / 168.1 us, the 16-key 2-stage config before 94.1 / 198.1, the unified kernel
        # 165.0 / 334.8; bf16 16 keys x 2 warps x 3 stages 131.8 / 249.6 us (96% / 101% of the 4.27
        # TB/s floor), the unified kernel 157.5 / 294.4 (still the choice for grouped queries past a
        # few sequences). FP8 since the scales lie head-major per block (lever 70, seventeenth
        # session): 16 keys x 1 warp x 3 stages 71.1 / 137.6 us against 73.3 / 143.1 for 8 x 1 x 4,
        # and in the engine the 8-key tile lost 1.6 ms per step at 64 x 1K (16-key configs 12.44-12.51
        # against 14.1 ms; docs/performance.md lever 71). Since the values lie head-major too (lever
        # 74): 72.5 / 138.5 us; 8 x 1 x 3 78.1 / 137.3, which the dense entry below takes at 128 x 1K
        "attention_row_decode_fp8": KernelConfig(1, 16, 1, 3),
        "attention_row_decode_dense_fp8": KernelConfig(1, 8, 1, 3),
        "attention_row_decode": KernelConfig(1, 16, 2, 3),
        # bf16 with the context in 16 splits (batch 1: 16 programs per head, a tile or two each): 8 keys
        # x 2 warps x 2 stages, Ouro-1.4B b1 4.595 -> 4.541 ms as a whole-table override (2026-12-03,
        # fourteenth session; 16 keys x 4 warps 4.562, 32 keys 4.740, 8 keys x 1 warp x 4 stages 4.917),
        # 4.415 -> 4.352 as this entry (fifteenth); at 8 splits it lost (hal/kernels/attend.py)
        "attention_row_decode_split": KernelConfig(1, 8, 2, 2),
        # FP8 at batch 1 (16 splits): bf16's 8 keys x 2 warps x 2 stages since levers 74-76 (head-major
        # values, exponent-byte scales): Ouro-1.4B b1 FP8 KV 4.221 / 4.225 ms -> 4.178 (bf16 4.175 in
        # the same call; 16 x 2 x 2 4.188, 8 x 1 x 3 4.228, 16 x 1 x 3 4.239), nineteenth session call
        # 1. Before them 8 x 1 x 4 (4.225 against 16 x 1 x 3's 4.278, seventeenth session)
        "attention_row_decode_split_fp8": KernelConfig(1, 8, 2, 2),
        # 2-15 splits (batch 1 of Nanbeige4.2-3B's 48 and Huginn-0125's 55 query heads: 8 splits):
        # 8-key tiles, where those steps had taken the whole-batch entries (16 x 2 x 3, FP8 16 x 1 x 3).
        # H200 sweeps by override (2026-12-04, twenty-third session): Nanbeige bf16 4.447-4.450 -> 4.402
        # ms (8 x 2 x 4 4.429, 8 x 1 x 3 4.421, 8 x 2 x 2 4.434, 8 x 4 x 3 4.472), FP8 KV 4.469-4.471 ->
        # 4.425-4.431 (8 x 2 x 3 4.468, 8 x 2 x 2 4.454, 8 x 1 x 4 4.441, 4 x 1 x 3 4.445). As these
        # entries, against the tree before (call 6): Nanbeige bf16 4.484 -> 4.425 / 4.436, FP8 4.500 ->
        # 4.461 / 4.465; Huginn FP8 30.938 -> 30.778, bf16 level (30.668 / 30.655)
        "attention_row_decode_split_few": KernelConfig(1, 8, 2, 3),
        "attention_row_decode_split_few_fp8": KernelConfig(1, 8, 1, 3),
        # fp32 prefill: 4 warps spill 16 bytes once the pages are loaded a tile ahead; 8 do not
        **_fp32_attention(KernelConfig(16, 32, 8, 2), KernelConfig(16, 32, 4, 2)),
        **_small_ops(4, 1),
        # one row: 16 x 256 bf16 = 8 KiB of weight per program and step, the next step's in flight
        # (stages 2: a register prefetch); 2..8 rows: 32 x 256 per stage, 4 cp.async stages; split-K
        # until 132 SMs have a program each (tools/decode_kernels_bench.py sweeps the alternatives)
        **_gemv(KernelConfig(1, 16, 4, 2, block_k=256, split_k=0),
                KernelConfig(16, 32, 4, 4, block_k=256, split_k=0)),
        # one row with PDL: 4 x 2048 slices on 4 warps, 32.1 us per layer of Ouro-1.4B's four
        # projections where cuBLAS takes 41.1 (tools/pdl_bench.py --quick, H200, 2026-12-02, eighth
        # session); Ouro-1.4B batch 1 4.97 ms/step against 5.31 on cuBLAS. Wider K in several slices
        # (Huginn's 5280, Nanbeige's 3072) measured slower than cuBLAS: those stay there
        "gemv_slice": KernelConfig(1, 4, 4, 1, block_k=2048, split_k=3),
        # one row on the tensor cores (levers 118-119; H100, forty-ninth session, two runs each, alternating):
        # FP8 weights as W8A8, x quantized per 512-wide slice (e4m3 wgmma): Ouro-1.4B b1 with FP8 weights
        # + KV 3.580 / 3.585 -> 3.256 / 3.254 ms; 16-bit slices on bf16 wgmma: 5.061 / 5.053 -> 4.974 /
        # 4.974 ms. The best of the chains' configs (tools/pdl_bench.py --fp8 / --quick) though neither
        # chain beat the slice kernel alone (25.3 vs 23.9, 44.4 vs 40.1 us a layer): in the step each
        # program's product after the PDL wait is the shorter. W8A8 up to 48 slices, so that Huginn-0125's
        # down (K = 17,920: 35) takes it too: its FP8 weights + KV b1 27.79 -> 25.31 ms (H100, lever 124).
        # block_m 16: decode batches of 2-8 rows too (each row quantized on its own), where the K-looping
        # W8A16 kernel widened every weight: Ouro-1.4B b8 with FP8 weights + KV 10.62 -> 6.18 ms (H100,
        # lever 122, fifty-second session)
        "gemv_slice_w8a8": KernelConfig(16, 128, 8, 1, block_k=512, split_k=48),
        # block_m 2: the CUDA Hal's decode steps of two rows too (its bf16 products past one row otherwise
        # run on cuBLAS): Ouro-1.4B b2 6.744 -> 6.400 ms, where 4 and 8 rows lost (7.18 -> 7.59, 8.37 -> 9.59;
        # H100, levers 126-127, fifty-second session)
        "gemv_slice_tc": KernelConfig(2, 128, 4, 1, block_k=256, split_k=32),
    },
    # A100: mma.sync; 164 KiB shared memory per SM, so two stages for the prefill tiles.
    "sm_80": {
        "attention_prefill": KernelConfig(128, 64, 8, 2),
        "attention_decode": KernelConfig(16, 64, 4, 3),
        "attention_prefill_fp8": KernelConfig(128, 64, 8, 2),
        "attention_decode_fp8": KernelConfig(16, 64, 4, 3),
        **_fp32_attention(KernelConfig(16, 32, 4, 2), KernelConfig(16, 32, 4, 2)),
        **_small_ops(4, 1),
        **_gemv(KernelConfig(1, 16, 4, 2, block_k=256, split_k=0),
                KernelConfig(16, 32, 4, 3, block_k=256, split_k=0)),
    },
    # MI300X: 8 waves on 128 query rows keep the prefill tile in 256 VGPRs without spills at
    # waves_per_eu=2; decode takes 32-key tiles (64-bit K/V pointers cost VGPRs) for 4 waves/SIMD.
    # FP8 KV prefill: 128x64 spills (the FP8 tiles go through LDS byte-wise before widening); 128x32
    # at one stage fits in 178 VGPRs, on gfx950 too.
    # 16x16 MFMA: 32x32 needs >= 32 rows and spilled at 128 rows. 64 KiB LDS per CU.
    "gfx942": _cdna3(),
    # MI350X: same tiles (same VGPR file); 160 KiB LDS; kpack is deprecated there (forced to 1).
    "gfx950": _cdna3(),
    # Anything else (other GPUs, the CPU interpreter): small tiles that fit every target.
    "default": {
        "attention_prefill": KernelConfig(64, 32, 4, 1),
        "attention_decode": KernelConfig(16, 32, 4, 1),
        "attention_prefill_fp8": KernelConfig(64, 32, 4, 1),
        "attention_decode_fp8": KernelConfig(16, 32, 4, 1),
        **_fp32_attention(KernelConfig(16, 32, 4, 1), KernelConfig(16, 32, 4, 1)),
        **_small_ops(4, 1),
        **_gemv(KernelConfig(1, 16, 4, 1, block_k=256, split_k=0),
                KernelConfig(16, 32, 4, 2, block_k=128, split_k=0)),
    },
}


def configs_for(arch: str) -> dict[str, KernelConfig]:
    """The table for `arch` ("sm_90", "sm_80", "gfx942", "gfx950"); any other arch gets "default".
    `LOOPSTACK_KERNEL_CONFIGS` (JSON, e.g. '{"attention_decode": [16, 32, 4, 3]}') replaces entries, and
    null removes an optional one: for tuning on a GPU without editing the table
    (tools/fp8_kernels_bench.py prints candidates)."""
    base = arch.split(":")[0]          # "gfx942:sramecc+:xnack-" -> "gfx942"
    table = {**_TABLES.get(base, _TABLES["default"]), **overrides(os.environ.get("LOOPSTACK_KERNEL_CONFIGS", ""))}
    return {name: config for name, config in table.items() if config is not None}


def overrides(text: str) -> dict[str, KernelConfig | None]:
    """Table entries from JSON `{"<kernel name>": [block_m, block_n, num_warps, num_stages, ...]}`; None
    where an optional kernel is given as null (its entry removed)."""
    if not text.strip():
        return {}
    try:
        entries = json.loads(text)
        return {_known(name, values is None): None if values is None else KernelConfig(*values)
                for name, values in entries.items()}
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"LOOPSTACK_KERNEL_CONFIGS={text!r}: {e}; expected JSON like "
                         """'{"attention_decode": [16, 32, 4, 3]}' (kernel name -> KernelConfig fields, or """
                         "null to remove an optional entry)") from None


def _known(name: str, removed: bool = False) -> str:
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(KERNEL_NAMES)}")
    if removed and name not in OPTIONAL_KERNEL_NAMES:
        raise ValueError(f"{name!r} cannot be removed (every table needs it); null removes only one of "
                         f"{', '.join(OPTIONAL_KERNEL_NAMES)}")
    return name


def all_configs() -> dict[str, dict[str, KernelConfig]]:
    """Every table by arch name, "default" included (what the cross-compile checks walk)."""
    return {arch: dict(table) for arch, table in _TABLES.items()}


def config_or_default(configs: dict[str, KernelConfig] | None, name: str,
                      fallback: str | None = None) -> KernelConfig:
    """Entry `name` of `configs` (None: the "default" table), or `fallback`'s in a table from before
    `name` had an entry."""
    table = configs or configs_for("default")
    return table[fallback] if fallback is not None and name not in table else table[name]
