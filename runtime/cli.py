"""What the Hydra entry points (`runtime.generate`, `runtime.serve`, `runtime.bench`) share: where
conf/ is, the schemas they register, the usage error, the known model names and the default one,
logging, and the Hal, the EngineConfig and the sampling defaults built from the config nodes (one
function each, used by all three). What they check in argv before Hydra runs is `runtime.cli_args`.

Only the entry points import this module; the rest of the runtime takes plain config objects.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import typing
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from runtime.config import (ENGINE_FIELDS_FROM_MODEL, BenchConfig, EngineConfig, GenerateConfig, HalConfig,
                            ModelConfig, ParallelConfig, ServeConfig)

# no model given: the packaged tiny model (when the install has it), as `runtime.generate` and
# `runtime.serve` both do
DEFAULT_MODEL = "ouro-tiny"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

HERE = Path(__file__).resolve().parent
# conf/ sits beside the packages in a checkout and inside runtime/ in an installed wheel
CONF_DIR = next(p for p in (HERE / "conf", HERE.parent / "conf") if (p / "generate.yaml").is_file())


class UsageError(Exception):
    """Bad arguments: printed as one message, exit status 2."""


def setup_logging(log_level: Any) -> None:
    """Log to stderr at `log_level` (any case: log_level=debug works); another word ends the command
    with one line listing the levels, before anything else runs."""
    level = str(log_level).upper()
    if not isinstance(logging.getLevelName(level), int):         # WARN and FATAL too, as logging takes them
        print(f"error: log_level={log_level} is not a level: use one of {', '.join(LOG_LEVELS)}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


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
    except (ValueError, RuntimeError, OSError, MemoryError, OverflowError) as exc:
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
    store.store(group="schema", name="engine", node=mutable_schema(EngineConfig, ENGINE_FIELDS_FROM_MODEL))
    store.store(group="schema", name="server", node=mutable_schema(ServerConfig, SERVER_FIELDS_FROM_MODEL))


def known_models() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if p.stem != "none")


def make_hal(hal_cfg: Any) -> Any:
    """The Hal a `hal:` node names (hal=cpu, hal.device_index=1, ...): the one place the CLIs build it."""
    import hal

    return hal.get(hal_cfg.name, device_index=hal_cfg.device_index,
                   attention_backend=hal_cfg.attention_backend)


def engine_config(cfg: Any, **overrides: Any) -> EngineConfig:
    """The `EngineConfig` of the `engine:` node (plus `overrides`, and the depth `model.num_loops`
    sets for requests that name none); a bad value is a UsageError naming the setting
    (`engine.max_num_seqs must be ...`)."""
    from omegaconf import OmegaConf

    node = cfg.engine
    fields = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})
    try:
        config = EngineConfig(**{**fields, **overrides})
    except ValueError as exc:
        raise UsageError(f"error: engine.{exc}") from None
    model = cfg.get("model")
    if model is None:
        return config
    check_model_node(model, config)
    return dataclasses.replace(config, default_num_loops=model.get("num_loops"))


def default_model() -> str | None:
    """The model of a CLI given none: the packaged ouro-tiny where this install has it."""
    from zoo.resolve import packaged_checkpoint

    return DEFAULT_MODEL if packaged_checkpoint(DEFAULT_MODEL) else None


def model_source(cfg: Any) -> str | None:
    """What the `model:` node points at (a folder or a name), else the default model, else None."""
    return cfg.model.path or cfg.model.name or default_model()


def checkpoint_sampling(cfg: Any) -> dict[str, Any]:
    """The sampling fields of the checkpoint's generation_config.json where the model node names no
    known model (`model.path=` a folder or a hub id in the local cache, or the packaged default); a
    named model's node carries them. {} where the checkpoint cannot be found (loading says why)."""
    from runtime.llm_options import sampling_of_generation_config
    from zoo.resolve import CheckpointError, resolve_checkpoint

    source = cfg.model.path or (None if cfg.model.name else default_model())
    if not source:
        return {}
    try:
        return sampling_of_generation_config(resolve_checkpoint(source))
    except CheckpointError:
        return {}


def check_model_node(model: Any, engine: EngineConfig) -> None:
    """The `model:` node's depth settings against the engine's limits, before anything loads."""
    loops = model.get("num_loops")
    if loops is not None and not (isinstance(loops, int) and 1 <= loops <= engine.max_num_loops):
        raise UsageError(f"error: model.num_loops={loops} is outside 1..{engine.max_num_loops}; pick a depth in that "
                         f"range (the limit is engine.max_num_loops)")
    threshold = model.get("exit_threshold")
    if threshold is not None and not 0 < threshold <= 1:
        raise UsageError(f"error: model.exit_threshold={threshold} must be in (0, 1] (1 = every loop)")


def check_port(port: Any) -> None:
    if not (isinstance(port, int) and 0 <= port <= 65535):
        raise UsageError(f"error: port={port} is not a TCP port; use 1..65535 (or 0 for any free port)")

