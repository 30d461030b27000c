"""The cuda Hal (lands with issue #5)."""
from __future__ import annotations

from hal.base import Hal


class CudaHal(Hal):
    name = "cuda"

    @classmethod
    def is_available(cls) -> bool:
        return False

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("hal 'cuda' is not implemented yet (issue #5); use hal=cpu")
