"""loopstack's hardware abstraction layer: `hal.get("cuda")`, `hal.detect()`, `hal.names()`."""
from hal.attention import AttentionBackend, AttnCaps, MetaCapacity, PagedBatch, dense_attention
from hal.base import Caps, Hal, MemInfo
from hal.registry import ENTRY_POINT_GROUP, UnknownHalError, detect, get, get_class, names, platform_of
from hal.resources import Comm, Graph, HostBuffer

__all__ = [
    "AttentionBackend", "AttnCaps", "Caps", "Comm", "Graph", "Hal", "HostBuffer", "MemInfo", "MetaCapacity", "PagedBatch",
    "dense_attention", "ENTRY_POINT_GROUP", "UnknownHalError", "detect", "get", "get_class",
    "names", "platform_of",
]
