"""The rocm Hal (lands with issue #9)."""
from __future__ import annotations

from hal.base import Hal


class RocmHal(Hal):
    name = "rocm"

    @classmethod
    def is_available(cls) -> bool:
        return False

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("hal 'rocm' is not implemented yet (issue #9); use hal=cpu")
