"""Triton kernels shared by the CUDA and ROCm Hals.

  attention.py   paged "unified" attention (prefill, chunked prefill, split-context decode) + reduce
  kv_write.py    K/V scatter into the paged cache by slot mapping
  ops.py         fused small ops: rms_norm (+ residual), rotary (NeoX / GPT-J), silu_and_mul
  backend.py     TritonPagedAttention, the AttentionBackend over these kernels
  configs.py     launch parameters per arch (the Hals pick the table); launch.py: target + options

Their checks live with the tools and tests: tests/kernels/kernel_reference.py (plain-torch
references), tests/kernels/interp.py (the Triton interpreter on the CPU), tools/xcompile.py
(cross-compiles for gfx942/gfx950/sm_90; CI runs it through tests/kernels/test_xcompile.py),
tools/kernel_bench.py (GPU timings at the Ouro-1.4B shapes).

Importing this package imports nothing from Triton; the modules above need `triton`.
"""
