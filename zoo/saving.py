"""Checkpoint saving in the released Hugging Face layout that `zoo.from_pretrained` reads back:
`config.json` (the family's config keys, `model_type`, `architectures`, `torch_dtype`) and
`model.safetensors` (or shards with an index) with the model's own weight names. Tokenizer files
are the caller's business.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from zoo.base import LoopedCausalLM, as_dtype

INDEX_NAME = "model.safetensors.index.json"


def config_dict(model: LoopedCausalLM, dtype: torch.dtype) -> dict[str, Any]:
    """The model's config as config.json keys (frozen dataclass fields, or `to_dict()`)."""
    config = model.config
    if dataclasses.is_dataclass(config):
        raw = dataclasses.asdict(config)
    elif hasattr(config, "to_dict"):
        raw = dict(config.to_dict())
    else:
        raise TypeError(f"cannot serialise config of type {type(config).__name__}: make it a dataclass "
                        f"or give it to_dict()")
    raw.update(architectures=[type(model).__name__], torch_dtype=str(dtype).removeprefix("torch."))
    return dict(sorted(raw.items()))


def weights_to_save(model: LoopedCausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """State dict in `dtype` on the CPU, each tied alias stored once (under its source name)."""
    from zoo.fp8 import fp8_state

    aliases = set(getattr(model, "tied_weights", {}))
    state = model.state_dict()
    fp8 = fp8_state(model)                  # FP8 linears: e4m3fn weights and [N, 1] float32 scales
    out = {}
    for name, tensor in state.items():
        if name in aliases:
            continue
        # floating weights in the checkpoint dtype; integer buffers, FP8 weights and their scales as they are
        value = tensor.detach()
        if hasattr(value, "full_tensor"):      # FSDP2 shards (DTensor): a collective, call on every rank
            value = value.full_tensor()
        if name in fp8:
            value = fp8[name]
        elif value.is_floating_point():
            value = value.to(dtype)
        out[name] = value.to("cpu").contiguous()
    return out


def save_pretrained(model: LoopedCausalLM, folder: str | os.PathLike, dtype: torch.dtype | str = torch.bfloat16,
                    max_shard_bytes: int | None = None) -> Path:
    """Write `config.json` and `model.safetensors` into `folder` (created if needed); returns it.

    With `max_shard_bytes`, weights larger than that are split into `model-0000i-of-0000n.safetensors`
    files plus `model.safetensors.index.json` (the sharded layout of released checkpoints). Weight
    files of an earlier save in the folder are removed first, so the loader never mixes two saves.
    The model itself is not changed (weights are copied, cast to `dtype`).
    """
    tp = getattr(model, "tensor_parallel", None)
    if tp is not None and tp.world_size > 1:
        raise ValueError(f"this model holds rank {tp.rank}'s shards of a {tp.world_size}-way tensor-parallel "
                         f"model, and save_pretrained writes whole checkpoints only: save a model loaded "
                         f"without tensor parallelism (parallel.tp=1)")
    dtype = as_dtype(dtype)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for old in [folder / "model.safetensors", folder / INDEX_NAME, *folder.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    weights = weights_to_save(model, dtype)
    shards = split_into_shards(weights, max_shard_bytes)
    if len(shards) == 1:
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: weights[n] for n in names}, str(folder / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, file))
        total = sum(t.numel() * t.element_size() for t in weights.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    from zoo.fp8 import compressed_tensors_config, has_fp8_weights

    config = config_dict(model, dtype)
    if has_fp8_weights(model):
        config["quantization_config"] = compressed_tensors_config(model)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def split_into_shards(weights: dict[str, torch.Tensor], max_shard_bytes: int | None) -> list[list[str]]:
    """Names grouped in order into shards of at most `max_shard_bytes` (a larger tensor alone)."""
    if not max_shard_bytes:
        return [list(weights)]
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards
