"""The AMD Hal (`hal=rocm`): the CUDA Hal's machinery through HIP, with gfx-arch decisions."""
from hal.rocm.hal import RocmHal, fp8_dtype_for, gfx_arch, is_wave64_arch, rocm_facts

__all__ = ["RocmHal", "fp8_dtype_for", "gfx_arch", "is_wave64_arch", "rocm_facts"]
