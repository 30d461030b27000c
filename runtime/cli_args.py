"""What the three CLIs check in argv before Hydra runs, so that bad input ends with one line naming
the fix: old option spellings and vLLM-style `--flags`, unknown keys (with the nearest option),
values Hydra's override grammar cannot read (with the quoted form to type), and overrides Hydra
cannot compose (a config group option that does not exist, a value its option's type does not take).

Only the entry points import this module (`check_argv`).
"""
from __future__ import annotations

import dataclasses
import shlex
import sys
import typing

from runtime.cli import CONF_DIR
from runtime.config import EngineConfig, HalConfig, ModelConfig, ParallelConfig


def check_argv(argv: list[str], schema: type, command: str, config_name: str, serves: bool = False) -> None:
    """Every check of this module, in order; exits 2 with one line at the first bad argument."""
    check_spellings(argv, serves)
    check_bare_words(argv, command)
    check_known_keys(argv, schema, command)
    check_quoting(argv)
    check_composes(argv, config_name)


# what a bare word most likely meant, per CLI (`python -m runtime.generate "Hello"`: a prompt)
BARE_WORD_KEYS = {"runtime.generate": "prompt", "runtime.bench": "workload"}


def check_bare_words(argv: list[str], command: str) -> None:
    """Exit with one line where an argument is not `key=value` (Hydra would print its grammar's
    lexer error): a prompt given bare to runtime.generate, a workload to runtime.bench. With any of
    Hydra's own flags (some take a bare value: `--cfg job`) Hydra's rules apply."""
    if any(arg.startswith("-") for arg in argv):
        return
    for arg in argv:
        if "=" in arg or arg.startswith("~"):
            continue
        key = BARE_WORD_KEYS.get(command)
        if key == "workload":
            hint = f"; a workload is workload=[{arg}] (several: 'workload=[b1,b64]')"
        elif key is not None:
            hint = f"; a prompt is {shlex.quote(f'{key}={arg}')}, or quoted for Hydra where it holds , ' ! ( = #"
        else:
            hint = ""
        print(f"error: {arg!r} is not an override (key=value){hint}; `--help` lists the options", file=sys.stderr)
        sys.exit(2)


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
    from runtime.server.config import ServerConfig

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
    # the fields that come from the model node are not options (mutable_schema leaves them out)
    return {k for k in keys if model_key(k) is None}


def model_key(key: str) -> str | None:
    """The `model.` key that sets an engine or server field the CLIs take from the model node
    (`engine.default_num_loops`: `model.num_loops`; `server.sampling.top_p`: `model.top_p`), else None."""
    from runtime.config import ENGINE_FIELDS_FROM_MODEL
    from runtime.server.config import SERVER_FIELDS_FROM_MODEL

    node, _, rest = key.partition(".")
    name, _, sub = rest.partition(".")
    fields = {"engine": ENGINE_FIELDS_FROM_MODEL, "server": SERVER_FIELDS_FROM_MODEL}.get(node, ())
    if name not in fields:
        return None
    if name == "sampling":         # the model node sets three; the others come from generation_config
        sub = sub or "temperature"
        return f"model.{sub}" if sub in ("temperature", "top_p", "top_k") else "the checkpoint's generation_config.json"
    return "model." + name.removeprefix("default_")


# nodes of fields that are not config groups: `engine=5` names no option
FIELD_NODES = ("engine", "parallel", "server")


def check_known_keys(argv: list[str], schema: type, command: str) -> None:
    """Exit with one line naming the nearest option when an override's key is not one of the CLI's
    (Hydra would print several lines ending in a `+key=` hint, and `+key=` is then silently unused)."""
    import difflib

    keys = option_names(schema)
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            continue
        key = arg.split("=", 1)[0].lstrip("+~")
        value = arg.split("=", 1)[1]
        if key in FIELD_NODES and key in keys and not value.lstrip().startswith("{"):   # {field: v} merges
            print(f"error: {key} is a node of options ({key}.<field>={value}), not a value; `--help` and the "
                  f"README's Options table list its fields", file=sys.stderr)
            sys.exit(2)
        source = model_key(key)
        if source is not None and key.split(".", 1)[0] in keys:
            fix = (f"set {source}= instead ({source}={value})" if source.startswith("model.")
                   else f"it comes from {source}")
            print(f"error: {key} is set from the model node, not on its own: {fix}", file=sys.stderr)
            sys.exit(2)
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
    sweeps = "-m" in argv or "--multirun" in argv or "hydra.mode=MULTIRUN" in argv
    for arg in argv:
        if "=" not in arg or arg.startswith("-"):
            continue
        try:
            override = parser.parse_overrides([arg])[0]
        except OverrideParseException:
            _print_quoted(arg)
            sys.exit(2)
        if override.is_sweep_override() and not sweeps:
            # `prompt=Hello,world` is a sweep for Hydra (one run per value), which these CLIs do not run
            key, value = arg.split("=", 1)
            listed = f" or a list: {shlex.quote(f'{key}=[{value}]')}" if key.lstrip("+") == "workload" else ""
            print(f"error: the comma in {arg!r} makes it a Hydra sweep (one run per value, which needs -m); "
                  f"text with a comma is quoted for Hydra inside the shell's quotes: "
                  f"{shlex.quote(f'{key}={_hydra_quoted(value)}')}{listed}", file=sys.stderr)
            sys.exit(2)


def _hydra_quoted(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _print_quoted(arg: str) -> None:
    key, value = arg.split("=", 1)
    hydra_value = _hydra_quoted(value)
    print(f"error: Hydra cannot read the override {arg!r}: its value holds characters of Hydra's "
          f"override grammar. Quote the value for Hydra inside the shell's quotes: "
          f"{shlex.quote(f'{key}={hydra_value}')}", file=sys.stderr)


# the type Hydra could not convert a value to (omegaconf's words) -> what to give instead
TYPE_HINTS = {"Integer": "give a whole number", "Float": "give a number", "valid bool": "give true or false",
              "ListConfig": "give a list in brackets, quoted for the shell: '{key}=[...]'"}


def check_composes(argv: list[str], config_name: str) -> None:
    """Exit with one line where Hydra cannot build the config from the overrides: a config group
    option that does not exist (`hal=cdua`: the group's options listed) or a value the option's type
    does not take (`engine.max_num_seqs=abc`). Hydra would print several lines and its search path.
    With any of Hydra's own flags (`--help`, `-m`, `--cfg`) Hydra's rules apply as they are."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import ValidationError

    if any(arg.startswith("-") or "=" not in arg for arg in argv):
        return
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose(config_name=config_name, overrides=list(argv))
    except MissingConfigException as exc:
        group, _, choice = (exc.missing_cfg_file or "").rpartition("/")    # hydra/job_logging/nope
        if not group or not exc.options:
            return                              # not an option of a group: Hydra says what it is
        where = "Hydra's own" if group.startswith("hydra") else f"conf/{group}/"
        print(f"error: {group}={choice} is not one of the {group} options: {', '.join(sorted(exc.options))} "
              f"({where})", file=sys.stderr)
        sys.exit(2)
    except ConfigCompositionException as exc:
        cause = exc.__cause__
        if not isinstance(cause, ValidationError) or not getattr(cause, "full_key", None):
            return
        key = cause.full_key
        value = next((a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+~") == key), "")
        reason = str(cause).splitlines()[0]
        hint = next((h for word, h in TYPE_HINTS.items() if word in reason), "see the README's Options table")
        print(f"error: {key}={value} is not a value {key} takes ({reason}): {hint.format(key=key)}",
              file=sys.stderr)
        sys.exit(2)
