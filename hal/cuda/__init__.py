"""The NVIDIA Hal (`hal=cuda`); its machinery is shared with `hal.rocm`."""
from hal.cuda.hal import CudaHal, DeviceFacts, cuda_facts

__all__ = ["CudaHal", "DeviceFacts", "cuda_facts"]
