"""Triton kernels shared by the CUDA and ROCm Hals.

  attend.py      which paged-attention kernel a batch takes (config, context splits), `paged_attention`
  attention.py   paged "unified" attention (prefill, chunked prefill, split-context decode)
  row_decode.py  multi-head decode attention, one softmax stream per tile row; for small batches it
                 also rotates q and stores this step's K/V itself; row_tiles.py: its tiles' loads and
                 softmax step
  gqa_decode.py  grouped-query decode past a few sequences, each page of K and V one TMA copy (sm_90)
  splits.py      the context split of decode attention: how many, the partials, the reduce kernel
  kv_write.py    K/V scatter into the paged cache by slot mapping
  ops.py         fused small ops by their Hal names: rotary (NeoX / GPT-J), silu_and_mul, and the norms
  norms.py       rms_norm (+ residual), norm_add_norm (a sublayer boundary: residual add and norms,
                 sandwich or pre-norm)
  gemv.py        decode projections for 1-8 rows with the small ops folded in (norm / SwiGLU
                 prologues, residual epilogue, deterministic split-K); gemv_prologue.py: the prologues
  gemv_slice.py  the one-row decode projection that holds its whole weight slice before it waits for
                 the kernel before (PDL); the CUDA Hal's default at one row, at the shapes it pays
  gemv_ops.py    the `*linear` Hal ops: route each call to gemv_slice.py, gemv.py or the unfused torch path
  pdl.py         programmatic dependent launch (sm_90+): every kernel here lets the next one launch
                 early and waits for the one before (`pdl_wait`); `run_launch` turns it on
  rotary_kv.py   rotary + the KV write (quantizing over 8-bit caches) in one launch
                 (TritonPagedAttention.attend_rotary)
  fp8_linear.py  the FP8-weight (W8A16) linear and the per-row activation quantization for `_scaled_mm`
  fresh.py       prefill without context over its fresh K/V through torch's flash (or cuDNN) kernel
  backend.py     TritonPagedAttention, the AttentionBackend over these kernels
  configs.py     launch parameters per arch (the Hals pick the table); launch.py: target + options

Their checks live with the tools and tests: tests/kernels/kernel_reference.py (plain-torch
references), tests/kernels/interp.py (the Triton interpreter on the CPU), tools/xcompile.py
(cross-compiles for gfx942/gfx950/sm_90; CI runs it through tests/kernels/test_xcompile.py),
tools/kernel_bench.py, tools/decode_kernels_bench.py and tools/pdl_bench.py (GPU timings at the
Ouro-1.4B shapes).

Importing this package imports nothing from Triton; the modules above need `triton`.
"""
