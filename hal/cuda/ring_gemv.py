"""One-row projections whose weights stream through a ring of TMA copies (Gluon, sm_90):
`y[1, N] = x[1, K] @ w[N, K]^T` for the 16-bit decode shapes that cuBLAS streams below the copy rate
(docs/performance.md, lever 114).

Why: at batch 1 a projection only streams its weight. cuBLAS reaches about 3.5 TB/s at Nanbeige4.2-3B's
widths, and the slice kernel (hal/kernels/gemv_slice.py), which holds its weights in registers, less
there (lever 38). Lever 97's probe (tools/persistent_tma_probe.py) showed that a ring of asynchronous
copies into shared memory, each stage with an mbarrier that says when its bytes have landed, streams
one product at 4.1-4.5 TB/s on an H200: it keeps several stages in flight from one program per SM,
which register-held loads cannot.

The kernel: the N rows are cut into chunks of BN rows dealt round-robin to the programs; each stage
is BOXES boxes of [BN, BK] along K (zeros past N and K: TMA fills them). The first STAGES stages are
issued before the wait on the launch before (weights depend on no kernel), then x is staged once in
shared memory and every stage multiplies into a [BN, BK] float32 tile, summed over K when a chunk is
done, so each output is a fixed sum order: the same bits run after run, not cuBLAS's bits.

Measured (H100, docs/benchmarks.md "forty-sixth session"): Nanbeige4.2-3B's b1 step 5.86 -> 5.38 ms with
its four products here, Huginn-0125's 40.68 -> 39.93 ms. SwiGLU staged in the ring (no silu_and_mul
launch before down) was slower than the launch it saves (Nanbeige 5.50 ms; Huginn 41.59): its staging
after the PDL wait sits on the step's critical path. So the table names those two models' shapes.
Ouro-1.4B's shapes led the slice kernel in a chain of products but lost in the step (lever 115).

E4M3 weights with a float32 scale per row (W8A16, lever 116) run on the same ring for tools only
(`ring_linear(..., scale=)`, tools/pdl_bench.py --fp8 --ring): widened by the conversion instructions or by
moving bits (`BITS`: a byte's sign, exponent and mantissa shifted into a float32 are its value times
2^-120, exact; 2^120 joins the row's scale), the ring took 33.6-52.0 us a layer of Ouro-1.4B's chain
where the FP8 slice kernel takes 23.8 (H100), so the engine keeps the slice kernel for FP8 weights.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# Triton 3.9 renamed the TMA copy, the CTA barrier and `_reinterpret` (3.6, the H200's, has the old names)
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

if hasattr(gl.shared_memory_descriptor, "reinterpret"):
    @gluon.jit
    def _as_tiles(flat, XT: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr):
        return flat.reinterpret(flat.dtype, [XT, BK], layout)
else:
    @gluon.jit
    def _as_tiles(flat, XT: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr):
        return flat._reinterpret(flat.dtype, [XT, BK], layout)

ENV = "LOOPSTACK_RING_GEMV"    # "1": every one-row 16-bit product it takes; "0": none; unset: the table
CONFIGS_ENV = "LOOPSTACK_RING_CONFIGS"    # JSON {"N,K": [RingConfig fields] or null}: replaces table entries
MAX_RING_BYTES = 160 << 10    # the 16-bit stages in flight (beside the staged x, in 227 KiB of shared memory)


class RingConfig(NamedTuple):
    programs_per_sm: int
    block_n: int        # rows per chunk
    block_k: int        # columns per box
    boxes: int          # boxes per stage
    stages: int         # stages in flight
    num_warps: int


# lever 97's best for wide K (Nanbeige4.2-3B's chain, call 7): 8-row chunks, 4 boxes of 256 per stage,
# 6 stages, 4 warps; one program per SM (96 KiB of ring + the staged x: 104-128 KiB at Nanbeige's K)
DEFAULT = RingConfig(1, 8, 256, 4, 6, 4)

# arch -> {(N, K): config}: the products measured faster than the library at one row
# (docs/performance.md, lever 114); LOOPSTACK_RING_GEMV=1 takes every shape it can, "0" none.
# Nanbeige4.2-3B's four (H100, 2026-12-06: its b1 step 5.86 -> 5.38 ms against cuBLASLt's table; each
# shape's own pick from tools/ring_sweep.py, H100, 2026-12-07: 5.378 / 5.373 -> 5.167 / 5.165 ms, lever 123)
# and Huginn-0125's q|k|v, o, fc, proj and adapter halves (39.93 against 40.68 ms; q|k|v, o and gate|up on
# their own picks, H100, 2026-12-07: 40.028 / 40.024 -> 37.739 / 37.750 ms, lever 125; 5280 x 10560 was not
# swept).
NANBEIGE_4_2_3B = {(8192, 3072): RingConfig(1, 16, 256, 2, 8, 4),
                   (3072, 6144): RingConfig(1, 8, 256, 4, 8, 4),
                   (21504, 3072): RingConfig(1, 16, 256, 2, 8, 4),
                   (3072, 10752): RingConfig(1, 8, 256, 2, 6, 4)}
HUGINN_0125 = {(15840, 5280): RingConfig(1, 16, 256, 2, 8, 4), (5280, 5280): RingConfig(1, 16, 256, 2, 8, 4),
               (35840, 5280): RingConfig(1, 8, 256, 2, 6, 8), (5280, 17920): DEFAULT,
               (5280, 10560): DEFAULT}
TABLE: dict[str, dict[tuple[int, int], RingConfig]] = {"sm_90": {**NANBEIGE_4_2_3B, **HUGINN_0125}}


# the sign (bit 31 of a sign-extended byte shifted by 20) and e4m3's exponent and mantissa, which land on
# float32's low exponent bits: the float32 is the e4m3 value times 2^-120 (exact, subnormals included)
_E4M3_F32_BITS = gl.constexpr(-0x78100000)      # 0x87F00000 as int32


@gluon.jit
def _issue(desc, bars, bufs, s, total, k_stages, pid, num_programs,
           BN: gl.constexpr, BK: gl.constexpr, BOXES: gl.constexpr, STAGES: gl.constexpr):
    """The TMA copies of this program's stage s (its chunk s // k_stages, K stage s % k_stages) into
    ring slot s % STAGES; nothing past `total`."""
    live = s < total
    slot = s % STAGES
    row = (pid + (s // k_stages) * num_programs) * BN
    kk = s % k_stages
    bar = bars.index(slot)
    mbarrier.expect(bar, BOXES * desc.block_type.nbytes, pred=live)
    for b in gl.static_range(BOXES):
        _tma_load(desc, [row, (kk * BOXES + b) * BK], bar, bufs.index(slot * BOXES + b),
                  pred=live)


@gluon.jit
def _ring_gemv_kernel(desc, x_ptr, out_ptr, scale_ptr, N, K, BN: gl.constexpr, BK: gl.constexpr,
                      BOXES: gl.constexpr, STAGES: gl.constexpr, XT: gl.constexpr, PDL: gl.constexpr,
                      SCALE: gl.constexpr, BITS: gl.constexpr, num_warps: gl.constexpr):
    pid = gl.program_id(0)
    num_programs = gl.num_programs(0)
    VEC: gl.constexpr = 16 // desc.dtype.primitive_bitwidth * 8
    # a lane reads 16 bytes, a warp whole rows of BK; the warps split a box's rows
    layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 * VEC // BK, BK // VEC], [num_warps, 1], [1, 0])
    rows_layout: gl.constexpr = gl.SliceLayout(1, layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, layout)
    bufs = gl.allocate_shared_memory(desc.dtype, [STAGES * BOXES, BN, BK], desc.layout)
    x_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    x_flat = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [XT * BK], x_layout)
    x_smem = _as_tiles(x_flat, XT, BK, x_layout)      # [XT, BK]: K tile t is row t
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    fence_async_shared()

    k_stages = gl.cdiv(K, BK * BOXES)
    mine = (gl.cdiv(N, BN) - pid + num_programs - 1) // num_programs
    total = mine * k_stages
    for s in gl.static_range(STAGES):          # weights depend on no kernel: before the wait
        _issue(desc, bars, bufs, s, total, k_stages, pid, num_programs, BN, BK, BOXES, STAGES)
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)

    # x once into shared memory, zeros past K (the ring's boxes past K are zeros too)
    offs = gl.arange(0, XT * BK, layout=gl.BlockedLayout([8], [32], [num_warps], [0]))
    x_flat.store(gl.load(x_ptr + offs, mask=offs < K, other=0.0))
    _cta_barrier()

    acc = gl.zeros([BN, BK], gl.float32, layout)
    for i in range(total):
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        kk = i % k_stages
        for b in gl.static_range(BOXES):
            w = bufs.index(slot * BOXES + b).load(layout)
            if BITS:    # e4m3 -> float32 by moving its bits (2^-120 of its value, subnormals too)
                wi = w.to(gl.int8, bitcast=True).to(gl.int32)
                wf = ((wi << 20) & _E4M3_F32_BITS).to(gl.float32, bitcast=True)
            else:
                wf = w.to(gl.float32)
            acc += wf * x_smem.index(kk * BOXES + b).load(cols_layout).to(gl.float32)[None, :]
        _cta_barrier()                         # every warp has read the slot before it is refilled
        _issue(desc, bars, bufs, i + STAGES, total, k_stages, pid, num_programs, BN, BK, BOXES, STAGES)
        if kk == k_stages - 1:
            rows = (pid + (i // k_stages) * num_programs) * BN + gl.arange(0, BN, layout=rows_layout)
            y = gl.sum(acc, axis=1)
            if SCALE:
                y = y * (gl.load(scale_ptr + rows, mask=rows < N, other=0.0) * (2.0 ** 120 if BITS else 1.0))
            gl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)
            acc = gl.zeros([BN, BK], gl.float32, layout)


def _x_tiles(k: int, config: RingConfig) -> int:
    return triton.next_power_of_2(-(-k // (config.block_k * config.boxes)) * config.boxes)


def takes(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """One contiguous 16-bit row against an `[N, K]` weight whose rows TMA can address: of x's dtype, or
    e4m3 with a float32 `scale` per row."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16) and x.is_contiguous()
            and weight.dtype == (x.dtype if scale is None else torch.float8_e4m3fn)
            and weight.dim() == 2 and weight.stride(1) == 1 and x.shape[1] == weight.shape[1]
            and (weight.stride(0) * weight.element_size()) % 16 == 0 and weight.data_ptr() % 16 == 0
            and (scale is None or (scale.dtype == torch.float32 and scale.numel() == weight.shape[0]
                                   and scale.is_contiguous())))


@functools.lru_cache(maxsize=None)
def _smem_layout(bits: int) -> Any:
    return gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=bits, rank=2)


# (data_ptr, dtype, shape, strides, box) -> descriptor: all a descriptor encodes, so a tensor that
# reuses a freed weight's memory with the same key gets a descriptor that is right for it too
_DESCRIPTORS: dict[tuple, TensorDescriptor] = {}


def _descriptor(weight: torch.Tensor, config: RingConfig) -> TensorDescriptor:
    key = (weight.data_ptr(), weight.dtype, tuple(weight.shape), tuple(weight.stride()), config.block_n,
           config.block_k)
    desc = _DESCRIPTORS.get(key)
    if desc is None:
        desc = TensorDescriptor.from_tensor(weight, [config.block_n, config.block_k],
                                            _smem_layout(weight.element_size() * 8))
        _DESCRIPTORS[key] = desc
    return desc


def ring_linear(x: torch.Tensor, weight: torch.Tensor, config: RingConfig = DEFAULT, num_programs: int = 0,
                pdl: bool = True, out: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                bits: bool = True) -> torch.Tensor:
    """`x[1, K] @ weight[N, K]^T` as `[1, N]` (`takes(x, weight)` must hold), or with an FP8 (e4m3)
    weight and its float32 `scale[N]`, `x @ (weight * scale[:, None])^T` (`takes(x, weight, scale)`); `bits`: widen
    e4m3 by moving bits rather than the conversion instructions. `num_programs` 0: one wave,
    `config.programs_per_sm` per SM."""
    n, k = weight.shape
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    if num_programs <= 0:
        num_programs = config.programs_per_sm * torch.cuda.get_device_properties(x.device).multi_processor_count
    num_programs = min(num_programs, -(-n // config.block_n))
    extra = {"launch_pdl": True} if pdl else {}
    _ring_gemv_kernel[(num_programs,)](_descriptor(weight, config), x, out, x if scale is None else scale, n, k,
                                       BN=config.block_n, BK=config.block_k, BOXES=config.boxes,
                                       STAGES=config.stages, XT=_x_tiles(k, config), PDL=pdl,
                                       SCALE=scale is not None, BITS=scale is not None and bits,
                                       num_warps=config.num_warps, **extra)
    return out


class RingOr:
    """The decode projections' product (the `gemm` of hal.kernels.gemv_ops.Gemv): the ring for the one-row
    shapes `shapes` names (all it takes with `every`), else `library` (cuBLASLt's table or F.linear)."""

    def __init__(self, library: Any, shapes: dict[tuple[int, int], RingConfig], every: bool, pdl: bool) -> None:
        self.library, self.shapes, self.every, self.pdl = library, shapes, every, pdl

    def config(self, x: torch.Tensor, weight: torch.Tensor) -> RingConfig | None:
        rows = x.reshape(-1, x.shape[-1]) if x.dim() else x
        if not takes(rows, weight):
            return None
        return self.shapes.get(tuple(weight.shape), DEFAULT if self.every else None)

    def prefers(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this product runs on the ring: the fused decode ops (hal/kernels/gemv_ops.py) hand
        such a product over rather than run their own kernel on it."""
        return self.config(x, weight) is not None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        config = self.config(x, weight)
        if config is None:
            return self.library(x, weight)
        return ring_linear(x.reshape(1, -1), weight, config, pdl=self.pdl).view(*x.shape[:-1], -1)


def table_overrides(text: str) -> dict[tuple[int, int], RingConfig | None]:
    """Ring table entries from JSON `{"N,K": [programs_per_sm, block_n, block_k, boxes, stages, num_warps]}`,
    None where a shape is given as null (the library runs it): what tools/ring_sweep.py measures, tried in the
    engine without a code change."""
    if not text.strip():
        return {}
    try:
        entries = json.loads(text)
        table = {}
        for shape, values in entries.items():
            n, k = (int(v) for v in shape.split(","))
            table[(n, k)] = None if values is None else _checked(RingConfig(*(int(v) for v in values)))
        return table
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{CONFIGS_ENV}={text!r}: {e}; expected JSON like "
                         """'{"8192,3072": [1, 8, 256, 4, 6, 4]}' (N,K of the weight -> programs_per_sm, """
                         "block_n, block_k, boxes, stages, num_warps; null: the library)") from None


def ring_bytes(config: RingConfig) -> int:
    """Shared memory the 16-bit stages in flight take on one SM."""
    return config.block_n * config.block_k * config.boxes * config.stages * 2 * config.programs_per_sm


def _checked(config: RingConfig) -> RingConfig:
    if min(config) < 1 or config.block_k % 16 or config.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{config}: every field >= 1, block_k a multiple of 16, num_warps a power of two "
                         "<= 16")
    if ring_bytes(config) > MAX_RING_BYTES:
        raise ValueError(f"{config}: its stages hold {ring_bytes(config) >> 10} KiB an SM, more than the "
                         f"{MAX_RING_BYTES >> 10} KiB of shared memory the ring may take")
    return config


def ring_or(library: Any, arch: str, pdl: bool) -> Any:
    """`library` wrapped with the ring where this arch's table (with LOOPSTACK_RING_CONFIGS's entries, or
    LOOPSTACK_RING_GEMV=1) has shapes; `library` itself where it has none (sm_90 only: TMA and Gluon's
    Hopper ops)."""
    env = os.environ.get(ENV)
    if env not in (None, "0", "1"):
        raise ValueError(f"{ENV}={env!r}: set 1 (every one-row product the ring takes), 0 (none) or leave it "
                         "unset (the shapes of its table)")
    if env == "0" or arch != "sm_90":
        return library
    shapes = {**TABLE.get(arch, {}), **table_overrides(os.environ.get(CONFIGS_ENV, ""))}
    shapes = {shape: config for shape, config in shapes.items() if config is not None}
    if not shapes and env != "1":
        return library
    return RingOr(library, shapes, env == "1", pdl)
