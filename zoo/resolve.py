"""Checkpoint resolution: a path, a known model name or a hub id -> a local checkpoint folder, and
the config.json in it.

Offline: names are looked up among the checkpoints shipped in the package (zoo/checkpoints/) and in
the local Hugging Face cache, never downloaded; a miss raises `CheckpointError` with the command that
downloads it. Apart from weight loading (zoo/loading.py) because the CLI and the runtime ask which
checkpoints exist, and where, without reading any weights.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
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
        raise CheckpointError(f"no checkpoint folder at {text!r} and it is not a known model name; "
                              f"known: {', '.join(sorted(HUB_IDS))}; or pass model.path=/path/to/checkpoint")
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


def read_config(folder: str | os.PathLike) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json; is it a Hugging Face checkpoint folder?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None
