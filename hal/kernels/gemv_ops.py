"""The decode projection ops (`linear`, `rms_norm_linear`, `silu_mul_linear`, `norm_residual_linear`,
and `fp8_linear`, `silu_mul_fp8_linear` for FP8 weights): `Gemv` routes each call to the skinny-GEMM
kernels of hal/kernels/gemv.py or to the unfused torch path.

Why routing sits apart from the kernels: which operands go to them is a measured choice (MAX_ROWS,
the prologue row limits below, both from H200 timings), while the kernels themselves take any row
count up to their MAX_DOT_ROWS; tools and tests launch the kernels directly, past these limits.
"""
from __future__ import annotations


from collections.abc import Callable

import torch

from hal.kernels.configs import KernelConfig, configs_for
from hal.kernels.gemv import (
    ADD_NORM,
    MAX_DOT_ROWS,
    NONE,
    NORM_ADD,
    RMS_NORM,
    SILU_AND_MUL,
    config_key,
    gemv_launch,
    plan,
)
from hal.kernels.gemv_slice import MAX_TENSOR_CORE_ROWS, num_splits, slice_gemv_launch
from hal.kernels.launch import backend_of, check_device, run_launch

MAX_ROWS = 8                     # decode batches the kernels take; more rows go to the GEMM (cuBLAS)
# Up to these rows the norms run in the projection's prologue; above, the standalone rms_norm kernel
# runs first and the projection takes its output (each program recomputes the row statistics, which
# costs L2 reads in proportion to the rows). tools/decode_kernels_bench.py on an H200 (2026-12-01):
# at 2 rows the prologues took 18-42 us where the separate launches took 12-19 us, and at 4 rows
# one value of the sandwich prologue was 2 bf16 ulps from the unfused kernels: one row only, and the
# sandwich not on the whole-slice kernel (`norm_residual_linear`, docs/performance.md lever 61)
NORM_PROLOGUE_MAX_ROWS = 1
SANDWICH_PROLOGUE_MAX_ROWS = 1
SLICE_KEY = "gemv_slice"         # a table with this entry runs one-row projections on hal/kernels/gemv_slice.py
A8_KEY = "gemv_slice_w8a8"       # with it, e4m3fn products of up to block_m rows run W8A8 on the slice kernel
TC_KEY = "gemv_slice_tc"         # with it, 16-bit slice products of up to block_m rows run on the tensor cores
WIDE_KEY = "gemv_wide"           # a table with this entry runs MAX_ROWS+1..MAX_DOT_ROWS rows on the tl.dot path
COUNTER_SLOTS = 1 << 16          # column blocks a split-K launch may have (N / BLOCK_N)
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def split_counters(device: torch.device) -> torch.Tensor:
    """Split-K arrival counters for a launch on `device`, zero between launches (the last split resets
    its own). Launches on one stream run one after another, so one set per stream serves them all;
    two streams may run at once (async speculation drafts on a side stream beside the verify), so
    each stream has its own set, and captured graphs share one more (graphs never replay at once).
    The graphs' set is made with the first eager set, since capture cannot allocate it zeroed."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    stream = -1 if capturing else torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    counters = _COUNTER_SETS.get((device, stream))
    if counters is None:
        if capturing:
            raise RuntimeError("the gemv split-K counters must be allocated before graph capture: "
                               "run the step once eagerly first (as the decode graphs do)")
        for key in ((device, stream), (device, -1)):
            if key not in _COUNTER_SETS:
                _COUNTER_SETS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
        counters = _COUNTER_SETS[(device, stream)]
    return counters


_COUNTER_SETS: dict[tuple[torch.device, int], torch.Tensor] = {}   # (device, stream or -1: graphs) -> set


class Gemv:
    """The fused projection ops bound to one config table and device size (what `Hal.op` returns).
    Each computes the kernel for bf16/fp16 inputs of at most MAX_ROWS rows, and otherwise the unfused
    path (`hal.kernels.ops` small ops + `gemm`, default `torch.nn.functional.linear`), bit for bit what
    the model's torch code computes through the Hal's other ops where `gemm` is F.linear."""

    def __init__(self, configs: dict[str, KernelConfig] | None = None, num_compute_units: int | None = None,
                 max_rows: int = MAX_ROWS, gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        self.configs = configs or configs_for("default")
        self.gemm = gemm or torch.nn.functional.linear     # the unfused product (a vendor's tuned GEMM)
        self.num_compute_units = num_compute_units
        self.max_rows = min(max_rows, MAX_ROWS)
        self.wide = self.configs.get(WIDE_KEY)

    def _fits(self, x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor | None,
              prologue: int = NONE) -> bool:
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        dtypes = {t.dtype for t in (x, weight, *others) if t is not None}
        return (len(dtypes) == 1 and x.dtype in KERNEL_DTYPES and weight.dim() == 2 and weight.stride(-1) == 1
                and self.takes(rows, weight.shape[1], prologue))

    def takes(self, rows: int, k: int, prologue: int = NONE) -> bool:
        """Whether a projection of `rows` rows of K with `prologue` runs here (else the unfused path):
        with `max_rows=1` (the CUDA Hal's default) only where the slice kernel takes it, one row, or the
        few rows of the tensor-core entry's block_m; decode batches of more than MAX_ROWS rows where the
        table has a `gemv_wide` entry."""
        if self.wide is not None and MAX_ROWS < rows <= MAX_DOT_ROWS:
            return True
        if self.max_rows > 1:
            return 0 < rows <= self.max_rows
        if rows < 1 or self._slice(k, prologue) is None:
            return False
        # (16-bit products only: the FP8 ops are a Gemv of MAX_ROWS rows, hal/cuda/fp8.py)
        return rows == 1 or self._tensor_core_slice(TC_KEY, k, rows) is not None

    def projection_takes(self, rows: int, k: int, after_norm: bool = False) -> bool:
        """The Hal op "projection_takes": whether these ops fuse a projection of `rows` rows of K (that
        normalises its input, `after_norm`), so a layer can keep its boundaries where they are not.
        A norm before the whole-slice kernel runs as its own launch (`rms_norm_linear`), so there a
        pre-norm layer does better to keep its boundaries (residual add and norm in one launch)."""
        if after_norm and rows == 1 and self._norm_apart(rows, k, RMS_NORM):
            return False
        return self.takes(rows, k, RMS_NORM if after_norm else NONE)

    def _norm_apart(self, rows: int, k: int, prologue: int) -> bool:
        """Whether a projection's norm prologue (RMS_NORM, ADD_NORM, NORM_ADD) runs as a launch of its
        own before it: past the prologue's row limit, and on the whole-slice kernel, where each
        program would recompute the row norms after its PDL wait, on the step's critical path (H200,
        Ouro-1.4B batch 1, 2026-12-03: 4.595 ms with the sandwich prologue, 4.406 without; lever 61)."""
        limit = NORM_PROLOGUE_MAX_ROWS if prologue == RMS_NORM else SANDWICH_PROLOGUE_MAX_ROWS
        return rows > limit or self._slice(k, prologue) is not None

    def _slice(self, k: int, prologue: int, fp8: bool = False) -> KernelConfig | None:
        """The whole-slice config for one row of K, or None. K in one slice; SwiGLU's input (which
        each program reads only for its own slice) and FP8 weights in up to `split_k` slices. More
        slices of 16-bit weights measured slower than cuBLAS at Huginn's and Nanbeige's widths
        (docs/performance.md, lever 38); FP8 weights that the slice kernel does not take run the
        K-looping kernel of gemv.py, slower than it at Ouro's down projection (lever 41)."""
        config = self.configs.get(SLICE_KEY)
        if config is None:
            return None
        splits = num_splits(k, config)
        several = prologue == SILU_AND_MUL or fp8
        return config if splits == 1 or (several and splits <= config.split_k) else None

    def _tensor_core_slice(self, key: str, k: int, rows: int) -> KernelConfig | None:
        """The slice config of a tensor-core form (`A8_KEY`: W8A8 for e4m3fn weights, lever 118; `TC_KEY`:
        16-bit weights, lever 119) for `rows` rows of K, or None: the table has no entry, K needs more
        than its `split_k` slices, or there are more rows than its `block_m` (1: one row only; up to 16)."""
        config = self.configs.get(key)
        if config is None or rows > min(config.block_m, MAX_TENSOR_CORE_ROWS):
            return None
        return config if num_splits(k, config) <= config.split_k else None

    def _run(self, x2: torch.Tensor, weight: torch.Tensor, prologue: int, **kw) -> torch.Tensor:
        check_device(x2)
        rows, (n, k) = x2.shape[0], weight.shape
        out = torch.empty(rows, n, dtype=x2.dtype, device=x2.device)
        fp8 = kw.get("weight_scale") is not None
        sliced = self._slice(k, prologue, fp8)                           # K as the slice kernel takes it
        slice_config = sliced if rows == 1 else None
        a8 = self._tensor_core_slice(A8_KEY, k, rows) if weight.dtype == torch.float8_e4m3fn else None
        if a8 is not None:
            slice_config, kw["a8"] = a8, True
        tc = self._tensor_core_slice(TC_KEY, k, rows) if sliced is not None and not fp8 else None
        if tc is not None:
            slice_config, kw["tensor_cores"] = tc, True
        if slice_config is not None:       # one row (or a tensor-core form's few): the whole-slice kernel (PDL)
            splits = num_splits(k, slice_config)
            if splits > 1:
                kw["workspace"] = torch.empty(splits * rows * n, dtype=torch.float32, device=x2.device)
                kw["counters"] = split_counters(x2.device)
            run_launch(slice_gemv_launch(x2, weight, out, slice_config, backend_of(x2.device), prologue=prologue,
                                         **kw))
            return out
        wide = rows > MAX_ROWS and self.wide is not None    # (tools call past MAX_ROWS on the "gemv" entry)
        config = self.wide if wide else self.configs[config_key(rows)]
        if self.num_compute_units is None:
            self.num_compute_units = _compute_units(x2.device)
        units = self.num_compute_units
        p = plan(rows, n, k, config, units, wide=wide)
        if p.split_k > 1:
            kw["workspace"] = torch.empty(p.split_k * rows * n, dtype=torch.float32, device=x2.device)
            kw["counters"] = split_counters(x2.device)
        # wide rows load their first weight tile before the PDL wait (docs/performance.md, lever 53)
        run_launch(gemv_launch(x2, weight, out, config, backend_of(x2.device), units, prologue=prologue,
                               preload=wide, **kw))
        return out

    def linear(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`linear(x, weight) (+ residual)`."""
        if not self._fits(x, weight, residual) or (residual is None and self._gemm_first(x, weight)):
            y = self.gemm(x, weight)
            return y if residual is None else residual + y
        out_res = None if residual is None else _rows(residual)
        return self._run(_rows(x), weight, NONE, out_residual=out_res).view(*x.shape[:-1], -1)

    def _gemm_first(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the unfused product claims this plain product before the kernels here: a `gemm` with
        `prefers(x, weight)` (the CUDA Hal's TMA ring, hal/cuda/ring_gemv.py, at the shapes its table
        names) streams it faster than they do, and with no prologue nothing is lost by handing it over."""
        prefers = getattr(self.gemm, "prefers", None)
        return prefers is not None and prefers(x, weight)

    def _plain(self, x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`x2 @ weight^T` for rows that fit here: the gemm where it claims them, else the kernels."""
        return self.gemm(x2, weight) if self._gemm_first(x2, weight) else self._run(x2, weight, NONE)

    def fp8_linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
        """W8A16 `x @ (weight * scale[:, None]).T` for x `[M, K]` bf16/fp16 with M <= MAX_ROWS, FP8 weight
        `[N, K]`, float32 `scale: [N]`; None for operands the kernel does not take (the caller's GEMM)."""
        rows = x.shape[0] if x.dim() == 2 else 0
        if not (self.takes(rows, weight.shape[-1]) and x.dtype in KERNEL_DTYPES and weight.dim() == 2
                and weight.stride(-1) == 1 and scale.dtype == torch.float32 and x.shape[-1] == weight.shape[1]):
            return None
        return self._run(_rows(x), weight, NONE, weight_scale=scale)

    def silu_mul_fp8_linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                            residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """W8A16 `linear(silu_and_mul(x), weight * scale[:, None]) (+ residual)`, x `[..., 2K]` = gate | up,
        in the rows `fp8_linear` takes; None for operands the kernel does not take (the caller then
        runs silu_and_mul and its FP8 GEMM)."""
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        if not (self.takes(rows, weight.shape[-1], SILU_AND_MUL) and x.dtype in KERNEL_DTYPES
                and weight.dim() == 2 and weight.stride(-1) == 1 and scale.dtype == torch.float32
                and x.shape[-1] == 2 * weight.shape[1] and (residual is None or residual.dtype == x.dtype)):
            return None
        out_res = None if residual is None else _rows(residual)
        return self._run(_rows(x), weight, SILU_AND_MUL, weight_scale=scale,
                         out_residual=out_res).view(*x.shape[:-1], -1)

    def rms_norm_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor) -> torch.Tensor:
        """`linear(rms_norm(x, norm_weight, eps), weight)`."""
        if not self._fits(x, weight, norm_weight, prologue=RMS_NORM):
            return self.gemm(self._rms_norm(x, norm_weight, eps), weight)
        x2 = _rows(x)
        if self._norm_apart(x2.shape[0], weight.shape[1], RMS_NORM):
            return self._plain(_rows(self._rms_norm(x2, norm_weight, eps)), weight).view(*x.shape[:-1], -1)
        return self._run(x2, weight, RMS_NORM, eps=eps, norm_weight=norm_weight).view(*x.shape[:-1], -1)

    def silu_mul_linear(self, x: torch.Tensor, weight: torch.Tensor,
                        residual: torch.Tensor | None = None) -> torch.Tensor:
        """`linear(silu_and_mul(x), weight) (+ residual)`; x `[..., 2K]` = gate | up."""
        if x.shape[-1] != 2 * weight.shape[-1] or not self._fits(x, weight, residual, prologue=SILU_AND_MUL):
            y = self.gemm(self._silu_and_mul(x), weight)
            return y if residual is None else residual + y
        out_res = None if residual is None else _rows(residual)
        return self._run(_rows(x), weight, SILU_AND_MUL, out_residual=out_res).view(*x.shape[:-1], -1)

    def norm_residual_linear(self, x: torch.Tensor, residual: torch.Tensor, post_norm_weight: torch.Tensor,
                             norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                             sum_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`(linear(rms_norm(h, norm_weight, eps), weight), h)` with the residual stream
        `h = residual + rms_norm(x, post_norm_weight, eps)` (sandwich norms, Ouro), or with
        `sum_first`, `h = rms_norm(x + residual, post_norm_weight, eps)` (Huginn)."""
        prologue = NORM_ADD if sum_first else ADD_NORM
        if not self._fits(x, weight, residual, post_norm_weight, norm_weight, prologue=prologue) \
                or residual.shape != x.shape:
            if residual.shape == x.shape:   # the boundary in one launch, as the layers run it without these ops
                y, h = self._norm_add_norm(x, residual, post_norm_weight, norm_weight, eps, sum_first)
                return self.gemm(y, weight), h
            if sum_first:
                h = self._rms_norm(x + residual, post_norm_weight, eps)
            else:
                h = self._rms_norm(x, post_norm_weight, eps, residual)
            return self.gemm(self._rms_norm(h, norm_weight, eps), weight), h
        x2 = _rows(x)
        if self._norm_apart(x2.shape[0], weight.shape[1], prologue):      # the boundary in one launch
            y, h = self._norm_add_norm(x, residual, post_norm_weight, norm_weight, eps, sum_first)
            return self._plain(_rows(y), weight).view(*x.shape[:-1], -1), h
        h = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        y = self._run(x2, weight, prologue, eps=eps, norm_weight=norm_weight,
                      residual=_rows(residual), res_norm_weight=post_norm_weight, stream_out=h)
        return y.view(*x.shape[:-1], -1), h.view(x.shape)

    # the unfused path: the same kernels the model's RMSNorm and silu_and_mul take through the Hal
    def _rms_norm(self, x, weight, eps, residual=None):
        from hal.kernels.ops import rms_norm

        return rms_norm(x, weight, eps, residual, self.configs)

    def _norm_add_norm(self, x, residual, post_weight, weight, eps, sum_first):
        from hal.kernels.norms import norm_add_norm

        return norm_add_norm(x, residual, post_weight, weight, eps, sum_first, self.configs)

    def _silu_and_mul(self, x):
        from hal.kernels.ops import silu_and_mul

        return silu_and_mul(x, self.configs)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`[..., K]` -> `[M, K]` with unit stride along K."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _compute_units(device: torch.device) -> int:
    from hal.kernels.backend import device_compute_units

    return device_compute_units(device)


def gemv_ops(configs: dict[str, KernelConfig] | None = None, num_compute_units: int | None = None,
             max_rows: int = MAX_ROWS, gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             ) -> dict[str, object]:
    """The ops by the names `Hal.op` uses, bound to one config table; calls of more than `max_rows`
    rows take the unfused path, whose products run through `gemm` (default `F.linear`)."""
    g = Gemv(configs, num_compute_units, max_rows, gemm)
    return {"linear": g.linear, "rms_norm_linear": g.rms_norm_linear, "silu_mul_linear": g.silu_mul_linear,
            "norm_residual_linear": g.norm_residual_linear, "projection_takes": g.projection_takes}
