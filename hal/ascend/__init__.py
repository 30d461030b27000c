"""Huawei Ascend (910B) through torch_npu: schema-checked against torch-npu 2.13 and simulated on the
CPU; not yet run on an NPU. See hal/ascend/README.md.

Importing this package never imports torch_npu; `AscendHal` does so on first device use.
"""
from hal.ascend.hal import AscendHal

__all__ = ["AscendHal"]
