"""Checkpoint saving in the released Hugging Face layout that `zoo.from_pretrained` reads back:
`config.json` (the family's config keys, `model_type`, `architectures`, `torch_dtype`) and one
`model.safetensors` with the model's own weight names. Tokenizer files are the caller's business.
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
    aliases = set(getattr(model, "tied_weights", {}))
    state = model.state_dict()
    out = {}
    for name, tensor in state.items():
        if name in aliases:
            continue
        # floating weights in the checkpoint dtype; integer buffers as they are
        value = tensor.detach()
        if hasattr(value, "full_tensor"):      # FSDP2 shards (DTensor): a collective, call on every rank
            value = value.full_tensor()
        value = value.to(dtype) if value.is_floating_point() else value
        out[name] = value.to("cpu").contiguous()
    return out


def save_pretrained(model: LoopedCausalLM, folder: str | os.PathLike,
                    dtype: torch.dtype | str = torch.bfloat16) -> Path:
    """Write `config.json` and `model.safetensors` into `folder` (created if needed); returns it.
    The model itself is not changed (weights are copied, cast to `dtype`)."""
    dtype = as_dtype(dtype)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights_to_save(model, dtype), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config_dict(model, dtype), indent=2) + "\n")
    return folder
