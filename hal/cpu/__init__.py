"""The CPU reference Hal: plain torch, the embedded default and the numerics oracle."""
from hal.cpu.hal import CpuHal

__all__ = ["CpuHal"]
