"""loopstack's model zoo: looped-depth LMs as plain, trainable `nn.Module`s.

    model = zoo.from_pretrained("path/to/Ouro-1.4B", dtype="bfloat16", device="cuda")
    with torch.device("meta"):                                            # any shape, no memory
        model = zoo.from_config("config.json")
    zoo.save_pretrained(model, "out/folder", dtype="bfloat16")              # the layout from_pretrained reads
    from zoo.training import expected_exit_loss, sample_num_loops          # Ouro objective, Huginn-style depth
"""
from __future__ import annotations

import importlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from zoo.base import CausalLMOutput, LoopedCausalLM, as_dtype, exit_distribution, first_exit_step
from zoo.context import DenseContext, ForwardContext, KVSpec, ModelOps
from zoo.loading import build_on_meta, load_weights, stored_dtype
from zoo.random_weights import fill_random
from zoo.resolve import HUB_IDS, CheckpointError, check_config_values, read_config, resolve_checkpoint
from zoo.saving import save_pretrained

# config.json model_type -> model class
FAMILIES = {
    "ouro": "zoo.ouro:OuroForCausalLM",
    "huginn_raven": "zoo.huginn:HuginnForCausalLM",
    "nanbeige": "zoo.nanbeige:NanbeigeForCausalLM",
}

__all__ = ["CausalLMOutput", "CheckpointError", "DenseContext", "ForwardContext", "HUB_IDS", "KVSpec",
           "LoopedCausalLM", "ModelOps", "as_dtype", "exit_distribution", "first_exit_step", "from_config",
           "from_pretrained", "model_class", "resolve_checkpoint", "save_pretrained"]


def model_class(model_type: str) -> type[LoopedCausalLM]:
    if model_type not in FAMILIES:
        raise CheckpointError(f"model_type {model_type!r} is not in the zoo; supported: {', '.join(FAMILIES)}")
    module, _, name = FAMILIES[model_type].partition(":")
    return getattr(importlib.import_module(module), name)


def _config_dict(config: dict[str, Any] | str | os.PathLike) -> dict[str, Any]:
    if isinstance(config, dict):
        return config
    path = Path(config)
    if path.is_dir():
        return read_config(path)
    if not path.is_file():
        raise CheckpointError(f"config {path} does not exist")
    return json.loads(path.read_text())


def build(config: dict[str, Any] | str | os.PathLike, where: str | os.PathLike | None = None
          ) -> tuple[type[LoopedCausalLM], Any]:
    """The model class and its typed config for a config.json dict or path (`where`: the dict's file,
    for error messages)."""
    raw = _config_dict(config)
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise CheckpointError("config has no model_type; is it a Hugging Face config.json?")
    cls = model_class(raw["model_type"])
    if where is None and not isinstance(config, dict):
        where = Path(config) / "config.json" if Path(config).is_dir() else config
    check_config_values(cls.config_class, raw, str(where or "config.json"))
    return cls, cls.config_class.from_dict(raw)


def _checkpoint_dtype(cfg: Any, folder: Path | None = None) -> torch.dtype:
    """The config's torch_dtype; else the dtype the weights are stored in; else float32."""
    declared = as_dtype(getattr(cfg, "torch_dtype", None) or None)    # a saved "auto" declares nothing
    if declared is not None:
        return declared
    return stored_dtype(folder) if folder is not None else torch.float32


def from_config(config: dict[str, Any] | str | os.PathLike, dtype: torch.dtype | str | None = None,
                device: torch.device | str | None = None, seed: int | None = None, tp_rank: int = 0,
                tp_size: int = 1, comm: Any = None) -> LoopedCausalLM:
    """A randomly initialised model of the config's shape (for tests and benchmarks), on `device`
    (default: torch's default device, so `with torch.device("meta"):` builds it without memory). Weights are drawn per tensor from `seed`
    (`zoo.random_weights`; seed None draws one from torch's global RNG), so `tp_size > 1` gives rank
    `tp_rank` exactly its slice of the `tp_size=1` model; `comm` carries the collectives (default:
    the world group of the device's Hal)."""
    cls, cfg = build(config)
    dtype = as_dtype(dtype) or _checkpoint_dtype(cfg)
    device = torch.device(device) if device is not None else torch.get_default_device()
    model = build_on_meta(cls, cfg, dtype)
    _shard(model, tp_rank, tp_size, comm, device)
    if device.type != "meta":
        if seed is None:
            seed = int(torch.randint(1 << 62, (), device="cpu"))
        fill_random(model, seed, getattr(cfg, "initializer_range", 0.02), dtype, device)
    return model.eval()


def _shard(model: LoopedCausalLM, tp_rank: int, tp_size: int, comm: Any, device: torch.device) -> None:
    if tp_size == 1 and tp_rank == 0:
        return
    from zoo.sharding import shard

    if comm is None and device.type != "meta":
        from hal.common.comm import TorchDistComm

        comm = TorchDistComm()                 # the world group of torch.distributed
    shard(model, tp_rank, tp_size, comm)


def from_pretrained(path_or_name: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None, tp_rank: int = 0, tp_size: int = 1,
                    comm: Any = None, weights_dtype: str | None = None) -> LoopedCausalLM:
    """Load a released checkpoint (a folder, a known name like "ouro-1.4b", or a hub id in the local
    cache). `dtype=None` keeps the checkpoint's `torch_dtype`; `device=None` means the CPU. With
    `tp_size > 1` the model is rank `tp_rank`'s tensor-parallel part (`zoo.sharding.shard`) and only
    its slices are read from the files; `comm` as in `from_config`.

    FP8: a pre-quantized checkpoint (compressed-tensors or `quant_method: fp8`, zoo/fp8_loading.py)
    loads its FP8 linears as `zoo.fp8.Fp8Linear`s; `weights_dtype="fp8"` quantizes a bf16/fp32
    checkpoint's linears per output channel as it loads (zoo/fp8.py). `dtype` is then the dtype of
    everything else (embeddings, norms, activations). Inference only; one device (not with tp_size > 1)."""
    from zoo.fp8 import quantize_fp8
    from zoo.fp8_loading import FP8_STORED, load_fp8_checkpoint, read_scheme, stored_dtypes

    if weights_dtype not in (None, "auto", "fp8"):
        raise ValueError(f"weights_dtype must be None, 'auto' or 'fp8', got {weights_dtype!r}")
    folder = resolve_checkpoint(path_or_name)
    raw = read_config(folder)
    cls, cfg = build(raw, Path(folder) / "config.json")
    dtype = as_dtype(dtype) or _checkpoint_dtype(cfg, folder)
    device = torch.device(device) if device is not None else torch.device("cpu")
    model = build_on_meta(cls, cfg)
    kinds = stored_dtypes(folder)
    other_fp8 = sorted(n for n, kind in kinds.items() if kind.startswith("F8_") and kind != FP8_STORED)
    if other_fp8:        # their scales would be ignored: refuse rather than load wrong weights
        raise CheckpointError(f"{folder} stores {kinds[other_fp8[0]]} tensors ({', '.join(other_fp8[:3])}): only "
                              f"F8_E4M3 (e4m3fn) FP8 weights load; convert the checkpoint or use its bf16 release")
    is_fp8 = read_scheme(raw) is not None or FP8_STORED in kinds.values()
    if tp_size > 1 and (is_fp8 or weights_dtype == "fp8"):
        raise ValueError("FP8 weights are not implemented with tensor parallelism (the row-parallel "
                         "linears would stay unquantized); load the bf16 checkpoint with weights_dtype=auto "
                         "for parallel.tp > 1, or run FP8 on one device")
    _shard(model, tp_rank, tp_size, comm, device)
    if is_fp8:
        load_fp8_checkpoint(model, folder, dtype, device)
    else:
        load_weights(model, folder, dtype, device)
    if weights_dtype == "fp8":
        quantize_fp8(model)
    model.name_or_path = str(folder)
    return model.eval()
