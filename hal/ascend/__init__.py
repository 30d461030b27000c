"""The ascend Hal (lands with issue #8)."""
from __future__ import annotations

from hal.base import Hal


class AscendHal(Hal):
    name = "ascend"

    @classmethod
    def is_available(cls) -> bool:
        return False

    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("hal 'ascend' is not implemented yet (issue #8); use hal=cpu")
