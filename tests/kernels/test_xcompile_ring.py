"""The TMA-ring one-row projection (hal/cuda/ring_gemv.py, Gluon) compiles for sm_90 at the model shapes
it may take, on the CPU: no spills, shared memory within an SM's, TMA copies and the PDL wait in the
PTX. (Level: compiles for sm_90; it runs only on the GPU, `tests/cuda/test_ring_gemv_cuda.py`.)"""
from __future__ import annotations

import pytest
import torch

ring = pytest.importorskip("hal.cuda.ring_gemv", exc_type=ImportError)

import xcompile  # noqa: E402

SHAPES = [(8192, 3072), (3072, 6144), (21504, 3072), (3072, 10752), (5280, 17920), (1000, 3000)]
CONFIGS = [ring.DEFAULT, ring.RingConfig(1, 16, 256, 2, 6, 4)]


def _compile(n: int, k: int, config: ring.RingConfig, fp8: bool = False, bits: bool = True):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compile as triton_compile, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    fn = ring._ring_gemv_kernel
    # host tensors: descriptors need only shapes here
    w = torch.zeros(n, k, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    x, y = torch.zeros(1, k, dtype=torch.bfloat16), torch.zeros(1, n, dtype=torch.bfloat16)
    desc = ring.TensorDescriptor.from_tensor(w, [config.block_n, config.block_k], ring._smem_layout(w.element_size() * 8))
    kwargs = dict(BN=config.block_n, BK=config.block_k, BOXES=config.boxes, STAGES=config.stages,
                  XT=ring._x_tiles(k, config), PDL=True, SCALE=fp8, BITS=fp8 and bits, num_warps=config.num_warps,
                  debug=False)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    scale = torch.zeros(n) if fp8 else x
    bound, specialization, options = binder(desc, x, y, scale, n, k, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton_compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"n{c.block_n}x{c.boxes}")
@pytest.mark.parametrize("n,k", SHAPES)
def test_the_ring_compiles_clean_for_sm_90(n, k, config):
    kernel = _compile(n, k, config)
    res = xcompile._nvidia_resources(kernel.asm["cubin"])
    assert res.get("LOCAL", 0) == 0 and res.get("STACK", 0) == 0, res
    assert kernel.metadata.shared <= xcompile.TARGETS["sm_90"].shared_limit, kernel.metadata.shared
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "mbarrier" in ptx
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx


@pytest.mark.parametrize("shape", [s for s, c in ring.TABLE["sm_90"].items() if c not in CONFIGS],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_table_s_own_configs_compile_clean_at_their_shapes(shape):
    """Each table entry's config (the per-shape picks of tools/ring_sweep.py) at the shape that takes it."""
    kernel = _compile(*shape, ring.TABLE["sm_90"][shape])
    res = xcompile._nvidia_resources(kernel.asm["cubin"])
    assert res.get("LOCAL", 0) == 0 and res.get("STACK", 0) == 0, res
    assert kernel.metadata.shared <= xcompile.TARGETS["sm_90"].shared_limit, kernel.metadata.shared


FP8_CONFIGS = [ring.RingConfig(1, 16, 256, 4, 4, 8), ring.RingConfig(2, 16, 256, 2, 4, 4)]


@pytest.mark.parametrize("bits", [True, False], ids=["bits", "cvt"])
@pytest.mark.parametrize("config", FP8_CONFIGS, ids=lambda c: f"{c.programs_per_sm}x{c.block_n}x{c.boxes}")
@pytest.mark.parametrize("n,k", [(6144, 2048), (2048, 5632), (1000, 3008)])
def test_the_fp8_ring_compiles_clean_for_sm_90(n, k, config, bits):
    """E4M3 weights with a scale per row; `bits` widens them by integer ops (no cvt from e4m3 in the
    product loop) and keeps float32 subnormals (no flush to zero: the values are 2^-120 of the weights')."""
    kernel = _compile(n, k, config, fp8=True, bits=bits)
    res = xcompile._nvidia_resources(kernel.asm["cubin"])
    assert res.get("LOCAL", 0) == 0 and res.get("STACK", 0) == 0, res
    ptx = kernel.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "griddepcontrol.wait" in ptx
    if bits:
        assert "e4m3" not in ptx and ".ftz" not in ptx
    else:
        assert "e4m3" in ptx
