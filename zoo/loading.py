"""Weight loading: (sharded) safetensors in the released Hugging Face layout, read into a model.

Models are built on the meta device and filled tensor by tensor from the files, so weights are
allocated once, in the target dtype, on the target device. Only safetensors are read: pickle
checkpoints can execute code and are refused, and no Python file in a checkpoint folder is run.
Finding the checkpoint folder and its config.json is zoo/resolve.py's part.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch.overrides import TorchFunctionMode

from zoo.parallel import ShardSpec, read_shard
from zoo.resolve import CheckpointError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
PROGRESS_MIN_BYTES = 256 << 20


def safetensors_files(folder: str | os.PathLike) -> list[Path]:
    """The weight files of a checkpoint: those named by model.safetensors.index.json, else
    model.safetensors, else every *.safetensors file. Pickle-only checkpoints are refused with an explanation."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({folder / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index.name} names shards that are not in {folder}: {', '.join(missing)}; "
                                  f"the download is incomplete")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = [p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise CheckpointError(
            f"{folder} holds only pickle weights ({', '.join(pickles[:3])}); loopstack reads safetensors only, "
            f"because unpickling can run arbitrary code. Convert once in a trusted environment, e.g. "
            f"`safetensors.torch.save_file(torch.load(f, weights_only=True), 'model.safetensors')`")
    raise CheckpointError(f"{folder} has no *.safetensors weight files")


@contextmanager
def open_safetensors(file: Path, device: str = "cpu") -> Iterator[Any]:
    """`safe_open` with a `CheckpointError` naming the file and the fix when it is not a complete
    safetensors file (a truncated or interrupted download, random bytes, another format)."""
    try:
        size = file.stat().st_size
        with safe_open(str(file), framework="pt", device=device) as f:
            yield f
    except (SafetensorError, OSError) as exc:      # a bad header, or a failed read of a short file
        if isinstance(exc, OSError) and not file.exists():
            raise
        raise CheckpointError(
            f"{file} is not a readable safetensors file ({size} bytes; {type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'no detail'}): it is probably truncated or corrupt, "
            f"e.g. an interrupted download; download the checkpoint again") from None


def stored_dtype(folder: str | os.PathLike) -> torch.dtype:
    """The floating dtype most of the checkpoint's weights are stored in (an FP8 checkpoint's float32
    scales do not count: its other weights' dtype is the one to compute in)."""
    with open_safetensors(safetensors_files(folder)[0]) as f:
        names = [n for n in f.keys() if not n.rsplit(".", 1)[-1].endswith(("scale", "scale_inv"))]
        kinds = [f.get_slice(n).get_dtype() for n in names[:64]]
    by_name = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    floats = [by_name[k] for k in kinds if k in by_name]
    return max(set(floats), key=floats.count) if floats else torch.float32


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


# torch.nn.init's random draws (and the tensor methods they call); on the meta device they would
# only cost time: their meta kernels import torch._dynamo, seconds of CPU in every process
_INIT_DRAWS = frozenset({"normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                         "xavier_normal_", "trunc_normal_", "orthogonal_"})


class SkipMetaInit(TorchFunctionMode):
    """Modules built on the meta device skip their init draws (the loaders fill the weights)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("tensor")        # torch.nn.init passes it by name
        is_meta = isinstance(first, torch.Tensor) and first.is_meta
        if is_meta and getattr(func, "__name__", None) in _INIT_DRAWS:
            return first
        return func(*args, **kwargs)


def build_on_meta(cls: type, cfg: Any, dtype: torch.dtype | None = None) -> Any:
    """`cls(cfg)` with every tensor on the meta device (no memory; parameters in `dtype`)."""
    with torch.device("meta"), default_dtype(dtype or torch.get_default_dtype()), SkipMetaInit():
        return cls(cfg)


def load_weights(model: torch.nn.Module, folder: str | os.PathLike, dtype: torch.dtype,
                 device: torch.device) -> None:
    """Fill `model` (built on the meta device) from the folder's safetensors, strictly: every
    parameter present with its shape, nothing unknown left over. A tensor-parallel model
    (`zoo.sharding.shard`) gets only its rank's slices: each is read from the file with
    `get_slice`, so no rank ever holds a whole sharded tensor."""
    files = safetensors_files(folder)
    tp = getattr(model, "tensor_parallel", None)
    specs: dict[str, ShardSpec] = tp.specs if tp is not None else {}
    local = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    expected = {name: specs[name].full_shape if name in specs else shape for name, shape in local.items()}
    tied = dict(getattr(model, "tied_weights", {}))
    # rotary tables some checkpoints store; we compute them (as non-persistent values) instead
    ignored = ("inv_freq", "freqs_cis", *getattr(model, "ignored_checkpoint_keys", ()))

    stored: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        with open_safetensors(file) as f:
            for name in f.keys():
                stored[name] = (file, tuple(f.get_slice(name).get_shape()))

    missing = [n for n in expected if n not in stored and not (n in tied and tied[n] in stored)]
    unexpected = [n for n in stored if n not in expected and not n.endswith(ignored)]
    mismatched = [f"{n}: file {stored[n][1]} vs model {expected[n]}"
                  for n in expected if n in stored and stored[n][1] != expected[n]]
    if missing or unexpected or mismatched:
        def part(title: str, items: list[str]) -> str:
            more = f" (+{len(items) - 8} more)" if len(items) > 8 else ""
            return f"\n  {title} ({len(items)}): {', '.join(items[:8])}{more}" if items else ""
        raise CheckpointError(f"checkpoint {folder} does not match {type(model).__name__}:"
                              + part("missing", missing) + part("unexpected", unexpected)
                              + part("shape mismatch", mismatched))

    # one source file per parameter: an alias stored twice is read once
    to_read = {n: n if n in stored else tied[n] for n in expected if not (n in tied and tied[n] in expected)}
    total_bytes = sum(_numel(local[n]) for n in to_read) * torch.finfo(dtype).bits // 8
    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for param, source in to_read.items():
        by_file.setdefault(stored[source][0], []).append(param)
    with _progress(total_bytes, f"loading {Path(folder).name}") as bar:
        for file, params in by_file.items():
            with open_safetensors(file) as f:
                for param in params:
                    source = to_read[param]
                    if param in specs:
                        tensor = read_shard(lambda index: f.get_slice(source)[index], specs[param])
                    else:
                        tensor = f.get_tensor(source)
                    tensor = tensor.to(device=device, dtype=dtype)
                    state[param] = tensor
                    bar.update(tensor.numel() * tensor.element_size())
    model.load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise CheckpointError(f"parameters not filled from {folder}: {', '.join(leftover[:8])}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@contextmanager
def _progress(total_bytes: int, desc: str) -> Iterator[Any]:
    from tqdm.auto import tqdm

    with tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
              disable=total_bytes < PROGRESS_MIN_BYTES, leave=False) as bar:
        yield bar
