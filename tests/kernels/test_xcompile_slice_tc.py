"""The one-row slice kernel's tensor-core forms (hal/kernels/gemv_slice.py `A8`, `TC`; docs/performance.md
levers 118-119) compile for sm_90 on the CPU: wgmma on e4m3 / bf16 operands, no spills, shared memory
within an SM's, and every store of the weight slice to shared memory ahead of the PDL wait (the point of
the form: the slice lands while the kernel before still runs). Level: compiles for sm_90."""
from __future__ import annotations

import pytest
import torch

import xcompile
from hal.kernels import gemv, gemv_slice
from hal.kernels.configs import KernelConfig

CONFIGS = [KernelConfig(1, 64, 4, 1, block_k=512), KernelConfig(1, 128, 4, 1, block_k=256)]


def _compile(n: int, k: int, config: KernelConfig, fp8: bool, swiglu: bool, rows: int = 1):
    x = torch.empty(rows, 2 * k if swiglu else k, dtype=torch.bfloat16)
    out = torch.empty(rows, n, dtype=x.dtype)
    launch = gemv_slice.slice_gemv_launch(
        x, torch.empty(n, k, dtype=torch.float8_e4m3fn if fp8 else x.dtype), out, config, "cuda",
        prologue=gemv.SILU_AND_MUL if swiglu else gemv.NONE, out_residual=torch.empty_like(out) if swiglu else None,
        workspace=torch.empty(1), counters=torch.empty(1, dtype=torch.int32),
        weight_scale=torch.empty(n) if fp8 else None, a8=fp8, tensor_cores=not fp8)
    return xcompile.compile_launch(launch._replace(kwargs={**launch.kwargs, "PDL": True}), xcompile.TARGETS["sm_90"])


def _assert_no_spills(kernel) -> None:
    res = xcompile._nvidia_resources(kernel.asm["cubin"])
    assert res.get("LOCAL", 0) == 0 and res.get("STACK", 0) == 0, res


def _slice_stores_and_wait(kernel, config: KernelConfig, fp8: bool) -> tuple[list[int], int]:
    """Checks what every tensor-core form must show (no spills, shared memory within an SM's, wgmma on its
    operands, enough 16-byte shared stores ahead of `griddepcontrol.wait` to hold the weight slice) and
    returns the PTX lines of every 16-byte shared store and of the wait."""
    _assert_no_spills(kernel)
    assert kernel.metadata.shared <= xcompile.TARGETS["sm_90"].shared_limit, kernel.metadata.shared
    lines = kernel.asm["ptx"].splitlines()
    operands = "e4m3.e4m3" if fp8 else "bf16.bf16"
    assert any("wgmma.mma_async" in line and operands in line for line in lines), operands
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    stores = [i for i, line in enumerate(lines) if "st.shared.v4.b32" in line]
    slice_bytes = config.block_n * config.block_k * (1 if fp8 else 2)
    assert sum(i < wait for i in stores) * 16 * 32 * config.num_warps >= slice_bytes   # the slice, before the wait
    return stores, wait


@pytest.mark.parametrize("fp8", [True, False], ids=["w8a8", "bf16"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}")
@pytest.mark.parametrize("n,k", [(6144, 2048), (2048, 5632)], ids=["qkv", "down-swiglu"])
def test_tensor_core_slices_compile_for_sm_90_with_the_slice_stored_before_the_wait(n, k, config, fp8):
    stores, wait = _slice_stores_and_wait(_compile(n, k, config, fp8, swiglu=k == 5632), config, fp8)
    assert max(stores) < wait                   # one row: every shared store (the x column too) before it


@pytest.mark.parametrize("fp8", [True, False], ids=["w8a8", "bf16"])
@pytest.mark.parametrize("n,k", [(6144, 2048), (2048, 5632)], ids=["qkv", "down-swiglu"])
def test_tensor_core_slices_of_eight_rows_compile_for_sm_90(n, k, fp8):
    """Several rows (a decode batch of 2-16) are the dot's 16 columns: still wgmma, no spills, the weight
    slice stored before the wait (the rows of x, which the kernel before makes, after it)."""
    config = KernelConfig(16, 128, 8, 1, block_k=512) if fp8 else KernelConfig(16, 128, 4, 1, block_k=256)
    _slice_stores_and_wait(_compile(n, k, config, fp8, swiglu=k == 5632, rows=8), config, fp8)


@pytest.mark.parametrize("n,k", [(4608, 3072), (3072, 10752), (15840, 5280), (5280, 17920)],
                         ids=["nanbeige-qkv", "nanbeige-down", "huginn-qkv", "huginn-down"])
def test_the_tables_w8a8_entry_compiles_at_nanbeige_and_huginn_shapes(n, k):
    """The sm_90 table's W8A8 entry takes every one-row e4m3fn product with K in up to split_k slices, so
    Nanbeige's and Huginn's too (K not a multiple of 512 at Huginn): 16-byte weight loads, no spills."""
    from hal.kernels.configs import all_configs

    kernel = _compile(n, k, all_configs()["sm_90"]["gemv_slice_w8a8"], fp8=True, swiglu=k > 10000)
    _assert_no_spills(kernel)
    assert any("ld.global" in line and ".v4.b32" in line for line in kernel.asm["ptx"].splitlines())
