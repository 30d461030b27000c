"""What the Hydra entry points (`runtime.generate`, `runtime.serve`) share: where conf/ is, the
schemas they register, the usage error, the known model names, and the Hal from a `hal:` node.

Only the entry points import this module; the rest of the runtime takes plain config objects.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from runtime.config import (BenchConfig, EngineConfig, GenerateConfig, HalConfig, ModelConfig, ParallelConfig,
                            ServeConfig)

HERE = Path(__file__).resolve().parent
# conf/ sits beside the packages in a checkout and inside runtime/ in an installed wheel
CONF_DIR = next(p for p in (HERE / "conf", HERE.parent / "conf") if (p / "generate.yaml").is_file())


class UsageError(Exception):
    """Bad arguments: printed as one message, exit status 2."""


@contextlib.contextmanager
def clear_errors(log_level: str):
    """Bad input ends the command with one line, not a traceback: a `UsageError` exits 2, a
    ValueError/RuntimeError/OSError (missing checkpoint, unknown hal, bad option) exits 1.
    `log_level=DEBUG` keeps the traceback of the latter."""
    try:
        yield
    except UsageError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
    except (ValueError, RuntimeError, OSError) as exc:
        if str(log_level).upper() == "DEBUG":
            raise
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


def mutable_schema(cls: type, exclude: tuple[str, ...] = ()) -> type:
    """A plain (not frozen) dataclass with `cls`'s fields and defaults, for Hydra to fill from YAML and
    overrides (it cannot override fields of a frozen dataclass). `cls(**node)` then validates."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):              # a nested config (EngineConfig.speculative)
            kind = mutable_schema(kind)
            fields.append((f.name, kind, dataclasses.field(default_factory=kind)))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, kind, dataclasses.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, kind, dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", fields)


def register_schemas() -> None:
    from runtime.server.config import SERVER_FIELDS_FROM_MODEL, ServerConfig

    store = ConfigStore.instance()
    store.store(group="schema", name="generate", node=GenerateConfig)
    store.store(group="schema", name="bench", node=BenchConfig)
    store.store(group="schema", name="serve", node=ServeConfig)
    store.store(group="schema", name="hal", node=HalConfig)
    store.store(group="schema", name="model", node=ModelConfig)
    store.store(group="schema", name="parallel", node=ParallelConfig)
    store.store(group="schema", name="engine", node=mutable_schema(EngineConfig))
    store.store(group="schema", name="server", node=mutable_schema(ServerConfig, SERVER_FIELDS_FROM_MODEL))


def known_models() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if p.stem != "none")


def make_hal(hal_cfg: Any) -> Any:
    """The Hal a `hal:` node names (hal=cpu, hal.device_index=1, ...)."""
    import hal

    return hal.get(hal_cfg.name, device_index=hal_cfg.device_index,
                   attention_backend=hal_cfg.attention_backend)
