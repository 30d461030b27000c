"""What the Hydra entry points (`runtime.generate`, `runtime.serve`, `runtime.bench`) share: where
conf/ is, the schemas they register, the usage error, the known model names and the default one,
the old option spellings and their new names, logging, and the Hal, the EngineConfig and the
sampling defaults built from the config nodes (one function each, used by all three).

Only the entry points import this module; the rest of the runtime takes plain config objects.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import shlex
import sys
import typing
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from runtime.config import (BenchConfig, EngineConfig, GenerateConfig, HalConfig, ModelConfig, ParallelConfig,
                            ServeConfig)

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
    store.store(group="schema", name="engine", node=mutable_schema(EngineConfig))
    store.store(group="schema", name="server", node=mutable_schema(ServerConfig, SERVER_FIELDS_FROM_MODEL))


def known_models() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if p.stem != "none")


def make_hal(hal_cfg: Any) -> Any:
    """The Hal a `hal:` node names (hal=cpu, hal.device_index=1, ...): the one place the CLIs build it."""
    import hal

    return hal.get(hal_cfg.name, device_index=hal_cfg.device_index,
                   attention_backend=hal_cfg.attention_backend)


def engine_config(cfg: Any, **overrides: Any) -> EngineConfig:
    """The `EngineConfig` of the `engine:` node (plus `overrides`); a bad value is a UsageError
    naming the setting (`engine.max_num_seqs must be ...`)."""
    from omegaconf import OmegaConf

    node = cfg.engine
    fields = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})
    try:
        return EngineConfig(**{**fields, **overrides})
    except ValueError as exc:
        raise UsageError(f"error: engine.{exc}") from None


def default_model() -> str | None:
    """The model of a CLI given none: the packaged ouro-tiny where this install has it."""
    from zoo.resolve import packaged_checkpoint

    return DEFAULT_MODEL if packaged_checkpoint(DEFAULT_MODEL) else None


def model_source(cfg: Any) -> str | None:
    """What the `model:` node points at (a folder or a name), else the default model, else None."""
    return cfg.model.path or cfg.model.name or default_model()


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


# ----- one spelling per option: the names the three CLIs used before they shared one engine node
def old_spellings() -> dict[str, str]:
    """Old option -> its name now: every EngineConfig field at the top level is `engine.<field>`."""
    renames = {f.name: f"engine.{f.name}" for f in dataclasses.fields(EngineConfig)}
    renames.update({"dtype": "model.dtype", "weights_dtype": "engine.weights_dtype",
                    "server.max_num_loops": "engine.max_num_loops"})
    return renames


# vLLM's command-line flags -> our override (the CLIs take Hydra's key=value, not --flags)
VLLM_FLAGS = {"model": "model=NAME (a known model) or model.path=/path/to/checkpoint", "host": "host=",
              "port": "port=", "dtype": "model.dtype=", "served-model-name": "server.model_name=",
              "api-key": "server.api_key= (or the LOOPSTACK_API_KEY environment variable)",
              "max-model-len": "engine.max_model_len=", "max-num-seqs": "engine.max_num_seqs=",
              "max-num-batched-tokens": "engine.max_num_batched_tokens=", "block-size": "engine.block_size=",
              "gpu-memory-utilization": "engine.gpu_memory_utilization=", "kv-cache-dtype": "engine.kv_dtype=",
              "enable-prefix-caching": "engine.enable_prefix_caching=true",
              "enforce-eager": "engine.graphs=false",
              "tensor-parallel-size": "torchrun --nproc-per-node=N ... (docs/tensor-parallel.md)"}
# Hydra's own flags pass through
HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "--version", "--cfg", "-c", "--resolve", "--package", "-p",
               "--info", "-i", "--run", "-r", "--multirun", "-m", "--shell-completion", "-sc", "--config-path",
               "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}


SERVER_FLAGS = ("host", "port", "served-model-name", "api-key")     # runtime.serve's alone


def check_spellings(argv: list[str], serves: bool = False) -> None:
    """Exit with one line naming the new spelling when an override uses an old one (`kv_mode=shared`
    is `engine.kv_mode=shared` now), or a vLLM-style `--flag` (`--port 8000` is `port=8000` in
    runtime.serve, `serves=True`; the other CLIs have no server options)."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and flag not in HYDRA_FLAGS:
            name = flag[2:]
            if name in SERVER_FLAGS and not serves:
                hint = f"runtime.serve's {VLLM_FLAGS[name]} (this CLI serves nothing)"
            else:
                hint = VLLM_FLAGS.get(name) or f"{name.replace('-', '_')}=..."
            print(f"error: {flag} is not an option here: the CLIs take Hydra overrides (key=value), e.g. "
                  f"{hint}; `--help` lists them", file=sys.stderr)
            sys.exit(2)
    renames = old_spellings()
    for arg in argv:
        key = arg.split("=", 1)[0].lstrip("+~")
        head = key.split(".", 1)[0]
        new = renames.get(key) or (f"engine.{key}" if head == "speculative" else None)
        if new is not None and "=" in arg:
            value = arg.split("=", 1)[1]
            print(f"error: {key}= is spelled {new}= now ({new}={value}); the three CLIs share one engine "
                  f"schema, see the README's Options", file=sys.stderr)
            sys.exit(2)


def option_names(schema: type) -> set[str]:
    """Every key a CLI of config class `schema` takes, dotted (`max_tokens`, `model.num_loops`,
    `engine.speculative.num_tokens`): its top-level fields and those of the nodes with schemas."""
    from runtime.server.config import SERVER_FIELDS_FROM_MODEL, ServerConfig

    nodes = {"hal": HalConfig, "model": ModelConfig, "parallel": ParallelConfig, "engine": EngineConfig,
             "server": ServerConfig}

    def names(cls: type, prefix: str) -> set[str]:
        out = set()
        for f in dataclasses.fields(cls):
            out.add(prefix + f.name)
            kind = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(kind):
                out |= names(kind, f"{prefix}{f.name}.")
        return out

    keys = names(schema, "")
    for node, cls in nodes.items():
        if node in keys:
            keys |= names(cls, f"{node}.")
    # the server's fields that come from the model node are not options (mutable_schema leaves them out)
    return {k for k in keys if not any(k == f"server.{f}" or k.startswith(f"server.{f}.")
                                       for f in SERVER_FIELDS_FROM_MODEL)}


def check_known_keys(argv: list[str], schema: type, command: str) -> None:
    """Exit with one line naming the nearest option when an override's key is not one of the CLI's
    (Hydra would print several lines ending in a `+key=` hint, and `+key=` is then silently unused)."""
    import difflib

    keys = option_names(schema)
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        head = key.split(".", 1)[0].split("/", 1)[0].split("@", 1)[0]     # hydra/job_logging=, hal@hal=
        if key in keys or head in keys and ("/" in key or "@" in key) or head == "hydra" \
                or head == "workloads" and "workloads" in keys:
            continue
        same_name = sorted(k for k in keys if k.endswith("." + key))
        # within its node when the node exists (model.foo: model.*, compared without "model."), else anywhere
        node = head + "." if "." in key and head in keys else ""
        pool = {k[len(node):]: k for k in keys if k.startswith(node)}
        near = same_name or [pool[k] for k in difflib.get_close_matches(key[len(node):], sorted(pool), n=1, cutoff=0.6)]
        hint = f" (did you mean {near[0]}={arg.split('=', 1)[1]}?)" if near else ""
        print(f"error: {key} is not an option of {command}{hint}; `--help` and the README's Options table "
              f"list them", file=sys.stderr)
        sys.exit(2)


def check_quoting(argv: list[str]) -> None:
    """Exit with the quoted form to type when Hydra's override grammar cannot read an argument (a
    prompt with `!`, `'`, `(`, `=`, `#`, ... must be quoted for Hydra inside the shell's quotes)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            continue
        try:
            parser.parse_overrides([arg])
        except OverrideParseException:
            _print_quoted(arg)
            sys.exit(2)


def _print_quoted(arg: str) -> None:
    key, value = arg.split("=", 1)
    hydra_value = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    print(f"error: Hydra cannot read the override {arg!r}: its value holds characters of Hydra's "
          f"override grammar. Quote the value for Hydra inside the shell's quotes: "
          f"{shlex.quote(f'{key}={hydra_value}')}", file=sys.stderr)
