"""The Ascend Hal simulated on the CPU (`hal=ascend-sim`): torch_npu's fused ops re-implemented in
plain torch against the real op schemas (`npu.py`, `attention.py`), run by `SimAscendHal` (`hal.py`)."""
from hal.ascend.sim.hal import SimAscendHal

__all__ = ["SimAscendHal"]
