"""The one-row decode projection that holds its whole weight slice before it waits for its input:
`y = prologue(x) @ W.T (+ residual)` for M = 1, W `[N, K]`, with programmatic dependent launch.

Why: at batch 1 a projection streams its weight once, and with PDL (hal/kernels/pdl.py) a kernel
may start while the one before it still runs. A program here loads its `[BLOCK_N, KS]` slice of W
(all of K up to KS) into registers first, then waits for the previous kernel, then reads x and
sums: the weight bytes of the next projection are in flight while the kernel before it (and its
tail) finishes. One slice per program also drops the K loop and, for K <= KS, the split-K sum.
Measured (H200, `tools/pdl_bench.py --quick`, 24 layers of Ouro-1.4B's four projections in one
graph, 2026-12-02): 4 x 2048 slices on 4 warps 32.1 us per layer with PDL, 37.4 without, cuBLAS
41.1; the K-looping kernel of gemv.py 47-51 us.

Prologues and the residual epilogue are gemv.py's (`PROLOGUE`, `ADD_RESIDUAL`, the same device
functions, so the same rounding). K > KS splits into `cdiv(K, KS)` programs per column block whose
fp32 partials the last to arrive sums in split order (deterministic, as in gemv.py). FP8 weights
(`W_SCALED`) widen in registers; the per-column scale multiplies the sum.

Two tensor-core forms (where a table names them: the sm_90 table since lever 120, docs/performance.md
levers 118-120): `A8` quantizes the program's slice of x to e4m3 by the slice's absmax and multiplies
the FP8 slice as it is (W8A8, wgmma on e4m3); `TC` multiplies a 16-bit slice on the tensor cores. In
both, x is column 0 of the dot's `[KS, 16]` second operand, and the compiler stores the slice to shared
memory as soon as it arrives, before the wait, instead of holding it in registers. The same forms take
a decode batch of up to 16 rows (each row one column of that operand, each quantized on its own): the
weight bytes and the dot are the one row's, only x grows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hal.common.kv_quant import quant_max
from hal.kernels import gemv
from hal.kernels.configs import KernelConfig
from hal.kernels.gemv import _finish, _weight_scale
from hal.kernels.gemv_prologue import NONE, _input_tile, _row_stats
from hal.kernels.launch import Launch, launch_options, next_pow2
from hal.kernels.pdl import pdl_wait

MAX_TENSOR_CORE_ROWS = 16     # rows the tensor-core forms take: the dot's second operand is [KS, 16]


@triton.jit
def _slice_gemv_kernel(out_ptr, x_ptr, w_ptr, res_ptr, stream_ptr, in_norm_ptr, res_norm_ptr, out_res_ptr,
                       part_ptr, count_ptr, w_scale_ptr, M, N, K, eps, stride_wn, stride_xm, stride_rm, stride_sm,
                       stride_om, stride_orm,
                       PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                       KS: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                       STATS_BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, W_SCALED: tl.constexpr,
                       PDL: tl.constexpr = False, A8: tl.constexpr = False,
                       TC: tl.constexpr = False, QMAX: tl.constexpr = 0.0, BLOCK_M: tl.constexpr = 1):
    """out `[M, N]` = prologue(x) `[M, K]` @ w `[N, K]`.T (+ out_res); M = 1, or up to BLOCK_M = 16 rows in
    the tensor-core forms. Grid `(cdiv(N, BLOCK_N), SPLIT_K)`; split-K partials go to part `[SPLIT_K, M, N]`
    fp32."""
    DT = out_ptr.dtype.element_ty
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = pid_k * KS + tl.arange(0, KS)
    k_mask = ks < K
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :]
    if EVEN_N and EVEN_K:      # no mask: the loads stay 16-byte vectors
        w = tl.load(w_ptrs)
    elif EVEN_K:
        w = tl.load(w_ptrs, mask=col_mask[:, None], other=0.0)
    else:
        w = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
    w_scale = _weight_scale(w_scale_ptr, cols, col_mask, W_SCALED, BLOCK_N)
    pdl_wait(PDL)             # the slice is in flight; x and the outputs belong to the kernels around
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < M
    inv_src = tl.zeros([BLOCK_M], tl.float32)
    inv_stream = inv_src
    if PROLOGUE == 1 or PROLOGUE >= 3:
        inv_src, inv_stream = _row_stats(x_ptr, res_ptr, res_norm_ptr, rows, row_mask, K, eps, stride_xm,
                                         stride_rm, PROLOGUE, BLOCK_M, STATS_BLOCK, ONE_PASS, DT)
    a = _input_tile(x_ptr, res_ptr, in_norm_ptr, res_norm_ptr, stream_ptr, rows, row_mask, ks, k_mask, K,
                    inv_src, inv_stream, tl.where(pid_n == 0, M, 0), stride_xm, stride_rm, stride_sm,
                    PROLOGUE, DT)                                                            # [BLOCK_M, KS]
    if A8:      # W8A8: the slice of x quantized like the weight, the product on the FP8 tensor cores
        acc = _a8_product(w, a, KS, QMAX, BLOCK_M)
    elif TC:    # 16-bit weights on the tensor cores: the slice staged in shared memory before the wait
        acc = _column_product(w, a.to(w.dtype), KS, BLOCK_M)
    else:
        acc = tl.sum(w.to(tl.float32) * a.to(tl.float32), 1)[None, :]                 # [1, BLOCK_N]
    _finish(acc, out_ptr, out_res_ptr, part_ptr, count_ptr, w_scale, rows, cols, row_mask, col_mask, M, N,
            pid_n, pid_k, stride_om, stride_orm, ADD_RESIDUAL, SPLIT_K, W_SCALED, BLOCK_M, BLOCK_N, DT)


@triton.jit
def _a8_product(w, a, KS: tl.constexpr, QMAX: tl.constexpr, BLOCK_M: tl.constexpr):
    """`a [BLOCK_M, KS] @ w [BLOCK_N, KS]^T` as `[BLOCK_M, BLOCK_N]` fp32 with each row of a quantized to
    w's FP8 format by one scale for the slice (`absmax / QMAX`, as `hal.kernels.fp8_rows.quantize_rows`
    does per row), so no weight is widened on the CUDA cores."""
    a32 = a.to(tl.float32)
    a_scale = tl.maximum(tl.max(tl.abs(a32), 1), 1e-12) / QMAX                          # [BLOCK_M]
    aq = tl.clamp(a32 / a_scale[:, None], -QMAX, QMAX).to(w.dtype)                     # [BLOCK_M, KS]
    return _column_product(w, aq, KS, BLOCK_M) * a_scale[:, None]                        # [BLOCK_M, BLOCK_N]


@triton.jit
def _column_product(w, a, KS: tl.constexpr, BLOCK_M: tl.constexpr):
    """`a [BLOCK_M, KS] @ w [BLOCK_N, KS]^T` as `[BLOCK_M, BLOCK_N]` fp32 on the tensor cores (a and w of
    one dtype): the rows of a are the columns of the dot's `[KS, 16]` second operand, 16 the least width
    tl.dot takes; one row is column 0, the other columns zeros."""
    if BLOCK_M == 1:
        col = tl.arange(0, 16)[None, :]
        b = tl.where(col == 0, tl.trans(a), tl.zeros([KS, 16], w.dtype))                # [KS, 16]
        return tl.trans(tl.sum(tl.dot(w, b), 1)[:, None])                                 # [1, BLOCK_N]
    return tl.trans(tl.dot(w, tl.trans(a)))                                               # [16, BLOCK_N]


def num_splits(k: int, config: KernelConfig) -> int:
    """Programs per column block: K in slices of `config.block_k`."""
    return -(-k // config.block_k)


def slice_gemv_launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, config: KernelConfig,
                      target: str, *, prologue: int = NONE, eps: float = 0.0,
                      norm_weight: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                      res_norm_weight: torch.Tensor | None = None, stream_out: torch.Tensor | None = None,
                      out_residual: torch.Tensor | None = None, workspace: torch.Tensor | None = None,
                      counters: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
                      a8: bool = False, tensor_cores: bool = False) -> Launch:
    """The launch of `out [M, N] = prologue(x) @ weight.T (+ out_residual)`; x `[M, K]` (`[M, 2K]` for
    SILU_AND_MUL), weight `[N, K]` with unit stride along K, rows with unit stride. M = 1, or up to
    MAX_TENSOR_CORE_ROWS in the tensor-core forms (`a8`, `tensor_cores`). `config.block_n` columns and
    `config.block_k` (a power of two) of K per program; K > block_k needs `workspace` (>= splits * M * N
    float32) and `counters` (int32 zeros, >= cdiv(N, block_n))."""
    rows, n = out.shape
    k = weight.shape[1]
    if rows != 1 and not (1 <= rows <= MAX_TENSOR_CORE_ROWS and (a8 or tensor_cores)):
        raise ValueError(f"the slice gemv takes one row, or up to {MAX_TENSOR_CORE_ROWS} on the tensor cores "
                         f"(a8, tensor_cores); got {rows}")
    if config.block_k != next_pow2(config.block_k):
        raise ValueError(f"gemv_slice's block_k must be a power of two, got {config.block_k}")
    split = num_splits(k, config)
    if a8 and (weight.dtype != torch.float8_e4m3fn or weight_scale is None or config.block_n < 16):
        raise ValueError("the W8A8 slice gemv takes e4m3fn weights with their scales and block_n >= 16, got "
                         f"{weight.dtype}, block_n {config.block_n}")
    if tensor_cores and (config.block_n < 16 or weight.dtype != x.dtype):
        raise ValueError("the slice gemv on the tensor cores takes a weight of x's dtype and block_n >= 16, got "
                         f"{weight.dtype}, block_n {config.block_n}")
    if split > 1 and (workspace is None or counters is None):
        raise ValueError("a split-K slice gemv needs a workspace and counters")
    return Launch(_slice_gemv_kernel, (-(-n // config.block_n), split), (
        out, x, weight, residual if residual is not None else x, stream_out if stream_out is not None else out,
        norm_weight if norm_weight is not None else weight,
        res_norm_weight if res_norm_weight is not None else weight,
        out_residual if out_residual is not None else out, workspace if workspace is not None else out,
        counters if counters is not None else out, weight_scale if weight_scale is not None else out,
        rows, n, k, eps, weight.stride(0), x.stride(0), _stride(residual), _stride(stream_out), out.stride(0),
        _stride(out_residual)), dict(
        PROLOGUE=prologue, ADD_RESIDUAL=out_residual is not None, BLOCK_N=config.block_n, KS=config.block_k,
        SPLIT_K=split, EVEN_K=k % config.block_k == 0, EVEN_N=n % config.block_n == 0,
        STATS_BLOCK=min(next_pow2(k), gemv.STATS_ELEMENTS), ONE_PASS=next_pow2(k) <= gemv.STATS_ELEMENTS,
        W_SCALED=weight_scale is not None, A8=a8, TC=tensor_cores,
        QMAX=quant_max(weight.dtype) if a8 else 0.0, BLOCK_M=1 if rows == 1 else MAX_TENSOR_CORE_ROWS,
        **launch_options(config, target)))


def _stride(rows: torch.Tensor | None) -> int:
    return rows.stride(0) if rows is not None else 0
