"""Hal names -> classes: the built-ins plus any vendor package registered under the entry-point
group `loopstack.hal`; `detect()` picks the first available; `platform_of` is the one place that
decides which platform a torch device belongs to. Models never look a Hal up here: whoever runs
them hands theirs over (`zoo.context.ModelOps`)."""
from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points
from typing import Any

import torch

from hal.base import Hal

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "loopstack.hal"
BUILTIN = {
    "cpu": "hal.cpu:CpuHal",
    "cuda": "hal.cuda:CudaHal",
    "rocm": "hal.rocm:RocmHal",
    "ascend": "hal.ascend:AscendHal",
    "ascend-sim": "hal.ascend.sim:SimAscendHal",
}
DETECT_ORDER = ("ascend", "rocm", "cuda")   # accelerators first; out-of-tree vendors next; cpu last


class UnknownHalError(ValueError):
    pass


def _load(target: str) -> type[Hal]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _plugins() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in BUILTIN}


def names() -> list[str]:
    """Every known Hal name: built-ins and installed vendor packages."""
    return sorted({*BUILTIN, *_plugins()})


def get_class(name: str) -> type[Hal]:
    if name in BUILTIN:
        return _load(BUILTIN[name])
    plugins = _plugins()
    if name in plugins:
        cls = plugins[name].load()
        if not (isinstance(cls, type) and issubclass(cls, Hal)):
            raise TypeError(f"entry point {name!r} in group {ENTRY_POINT_GROUP!r} gives {cls!r}, not a Hal subclass")
        return cls
    raise UnknownHalError(f"unknown hal {name!r}; known: {', '.join(['auto', *names()])}")


def detect() -> str:
    """The name of the first available Hal: an accelerator if one is present, else "cpu"."""
    for name in (*DETECT_ORDER, *sorted(_plugins())):
        try:
            if get_class(name).is_available():
                return name
        except Exception as exc:  # a broken vendor package must not stop detection
            log.debug("hal %s not available: %s", name, exc)
    return "cpu"


def get(name: str = "auto", **options: Any) -> Hal:
    """A Hal instance by name ("auto" detects). Options go to the Hal's constructor
    (`device_index`, `attention_backend`, vendor-specific ones such as `sim_any_shape`)."""
    if name == "auto":
        name = detect()
        log.info("hal=auto chose %s", name)
    cls = get_class(name)
    substitute = cls.substitute()
    if substitute is not None:
        log.info("hal=%s stands for hal=%s here", name, substitute)
        name, cls = substitute, get_class(substitute)
    if not cls.is_available():
        raise RuntimeError(f"hal {name!r} is not available on this machine; "
                           f"available here: {', '.join(n for n in names() if _available(n))}")
    instance = cls(**options)
    _check_device_index(instance, options.get("device_index"))
    return instance


def _check_device_index(instance: Hal, index: Any) -> None:
    # a wrong index would fail later inside the vendor runtime, far from the setting that caused it
    if index is None:
        return
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"hal.device_index must be a device number (0, 1, ...) or null, not {index!r}")
    count = instance.device_count()
    if index >= count:
        where = f" or make more visible ({instance.visible_devices_env})" if instance.visible_devices_env else ""
        raise ValueError(f"hal.device_index={index}, but hal {instance.name} sees {count} device(s): pick one "
                         f"of 0..{count - 1}{where}")


def _available(name: str) -> bool:
    try:
        return get_class(name).is_available()
    except Exception:
        return False


def platform_of(device: torch.device | str) -> str:
    """The Hal name for a torch device: cpu, cuda or rocm (both torch "cuda"), ascend ("npu")."""
    device_type = torch.device(device).type
    if device_type == "cuda":
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"
    if device_type == "npu":
        return "ascend"
    return device_type
