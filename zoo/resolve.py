"""Checkpoint resolution: a path, a known model name or a hub id -> a local checkpoint folder, and
the config.json in it.

Offline: names are looked up among the checkpoints shipped in the package (zoo/checkpoints/) and in
the local Hugging Face cache, never downloaded; a miss raises `CheckpointError` with the command that
downloads it. Apart from weight loading (zoo/loading.py) because the CLI and the runtime ask which
checkpoints exist, and where, without reading any weights.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
import types
import typing
from typing import Any

log = logging.getLogger(__name__)

# names users type -> hub repository ids (the checkpoints themselves are never downloaded by us)
HUB_IDS = {
    "ouro-1.4b": "ByteDance/Ouro-1.4B",
    "ouro-1.4b-thinking": "ByteDance/Ouro-1.4B-Thinking",
    "ouro-2.6b": "ByteDance/Ouro-2.6B",
    "ouro-2.6b-thinking": "ByteDance/Ouro-2.6B-Thinking",
    "huginn-0125": "tomg-group-umd/huginn-0125",
    "nanbeige4.2-3b": "Nanbeige/Nanbeige4.2-3B",
}
# small checkpoints shipped inside the package, in zoo/checkpoints/<name>/ (docs/ouro-tiny.md)
PACKAGED_DIR = Path(__file__).resolve().parent / "checkpoints"
PACKAGED_NAMES = ("ouro-tiny",)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or does not match the model; the message names the fix."""


def resolve_checkpoint(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """A local folder for a path, a known model name (`ouro-1.4b`) or a hub id, looked up in the
    local Hugging Face cache only (offline); raises `CheckpointError` with download instructions."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        raise CheckpointError(f"{path} is a file; pass the checkpoint folder that holds config.json")
    text = str(name_or_path)
    if text.lower() in PACKAGED_NAMES:
        return _packaged(text.lower())
    repo_id = HUB_IDS.get(text.lower(), text if text.count("/") == 1 and not text.startswith((".", "/")) else None)
    if repo_id is None:
        raise CheckpointError(f"no checkpoint folder at {text!r} (a folder holding config.json and the "
                              f"safetensors) and it is not a known model name "
                              f"({', '.join(sorted([*HUB_IDS, *PACKAGED_NAMES]))})")
    cached = _hub_cache_snapshot(repo_id, cache_dir)
    if cached is None:
        # "org/name" is a hub id and a relative path alike: say which folder was looked for too
        folder = "" if text.lower() in HUB_IDS else f" and there is no folder {str(path.resolve())!r}"
        raise CheckpointError(
            f"model {text!r} ({repo_id}) is not in the local Hugging Face cache{folder}. Download it with\n"
            f"    huggingface-cli download {repo_id}\n"
            f"or pass model.path=/path/to/checkpoint (a folder with config.json and *.safetensors)")
    return cached


def packaged_checkpoint(name: str) -> Path | None:
    """The folder of a checkpoint shipped in the package, or None where this install lacks it."""
    folder = PACKAGED_DIR / name
    return folder if name in PACKAGED_NAMES and (folder / "config.json").is_file() else None


def _packaged(name: str) -> Path:
    folder = packaged_checkpoint(name)
    if folder is None:
        raise CheckpointError(
            f"the packaged model {name!r} is not in this install ({PACKAGED_DIR / name} has no config.json). "
            f"Train it with `PYTHONPATH=. python examples/train_looped.py --out {PACKAGED_DIR / name}` "
            f"(docs/ouro-tiny.md), or pass model.path=/path/to/checkpoint")
    return folder


def _hub_cache_snapshot(repo_id: str, cache_dir: str | os.PathLike | None) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache_dir))
    except Exception as exc:  # not cached (LocalEntryNotFoundError), or hub cache unreadable
        log.debug("%s not in the local hub cache: %s", repo_id, exc)
        return None
    return folder if (folder / "config.json").is_file() else None


def check_config_values(config_class: type, raw: Any, where: str = "config.json") -> None:
    """CheckpointError naming the key where a config.json is not an object, or a value's type is not
    its field's (`"hidden_size": "512"`), or a size is not positive; the model code would fail later
    with a torch error that names neither."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} must be a JSON object of settings, got a {type(raw).__name__}")
    hints = typing.get_type_hints(config_class)
    for f in dataclasses.fields(config_class):
        value = raw.get(f.name)
        if value is None:
            continue
        kind = hints[f.name]
        kinds = typing.get_args(kind) if typing.get_origin(kind) in UNIONS else (kind,)
        if not any(_is_a(value, kind) for kind in kinds):
            wanted = " or ".join(getattr(k, "__name__", str(k)) for k in kinds if k is not type(None))
            raise CheckpointError(f"{where}: {f.name} must be {wanted}, got {value!r}")
        if (f.name.endswith("size") or f.name in POSITIVE_KEYS) and isinstance(value, int) and value < 1:
            raise CheckpointError(f"{where}: {f.name} must be at least 1, got {value}")


UNIONS = (typing.Union, types.UnionType)
POSITIVE_KEYS = ("hidden_size", "n_embd", "num_attention_heads", "n_heads", "num_hidden_layers")


def _is_a(value: Any, kind: Any) -> bool:
    origin = typing.get_origin(kind)
    if origin in (list, tuple):
        inner = typing.get_args(kind)[:1]
        return isinstance(value, (list, tuple)) and all(_is_a(v, inner[0]) for v in value) if inner else True
    if origin is dict:
        return isinstance(value, dict)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(kind, type) and isinstance(value, kind)


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; is it a Hugging Face checkpoint folder?")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must be a JSON object of settings, got a {type(raw).__name__}")
    return raw
