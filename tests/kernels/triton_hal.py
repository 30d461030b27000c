"""The CPU Hal with the Triton attention backend, the engine tests' stand-in for a GPU: every KV write
and attention of the engine runs in hal/kernels (interpreted inside `interp.interpreter()`), the rest on
the CPU."""
from hal.cpu import CpuHal
from hal.kernels.backend import TritonPagedAttention


class TritonOnCpu(CpuHal):
    """`backend_kwargs` go to `TritonPagedAttention` (configs, num_compute_units, fresh_attention, ...);
    `kv_dtype` comes from the engine, as the CUDA Hal takes it."""

    def __init__(self, **backend_kwargs) -> None:
        super().__init__()
        self.backend_kwargs = backend_kwargs

    def attention(self, num_heads, num_kv_heads, head_dim, dtype, block_size=None, backend=None,
                  kv_dtype=None):
        return TritonPagedAttention(num_heads, num_kv_heads, head_dim, dtype, self.device(), block_size or 16,
                                    kv_dtype=kv_dtype, **self.backend_kwargs)
