"""Pre-quantized FP8 checkpoints: the compressed-tensors "float-quantized" layout (llm-compressor) and
the `quant_method: fp8` layout (vLLM / Hugging Face FP8 checkpoints), read into `zoo.fp8.Fp8Linear`s.

A linear is FP8 when its `*.weight` is stored as `F8_E4M3`; its scale is
- `*.weight_scale` `[N]` or `[N, 1]`: per output channel, taken as is;
- `*.weight_scale` with one element: per tensor, repeated for every channel (exact);
- `*.weight_scale_inv` `[ceil(N / bn), ceil(K / bk)]` (`weight_block_size: [bn, bk]`): block-wise; the
  weight is dequantized block by block and quantized again per output channel (not exact: one more
  rounding to e4m3, logged).
Static activation and KV scales (`*.input_scale`, `*.k_scale`, `*.v_scale`) are ignored: activations
stay bf16 or are quantized per row on the fly (hal/cuda/fp8.py), KV per token (hal/common/kv_quant.py).

Loading goes through the model dtype: every e4m3 value is exact in bf16, fp16 and fp32, so the
weights are read by `zoo.loading.load_weights` as for any checkpoint and then cast back to e4m3
bit for bit, next to their scales.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

import torch

from zoo.fp8 import Fp8Linear
from zoo.loading import load_weights, open_safetensors, safetensors_files
from zoo.resolve import CheckpointError

log = logging.getLogger(__name__)

FP8_STORED = "F8_E4M3"
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
IGNORED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale", ".output_scale")
METHODS = ("compressed-tensors", "fp8")


class Fp8Scheme(NamedTuple):
    method: str                                 # "compressed-tensors" | "fp8"
    block_size: tuple[int, int] | None          # block-wise scales [bn, bk]; None: per channel or tensor


def read_scheme(config: dict[str, Any]) -> Fp8Scheme | None:
    """The FP8 scheme of a config.json's `quantization_config`, None for an unquantized checkpoint;
    `CheckpointError` for a quantization this loader does not read."""
    quant = config.get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method not in METHODS:
        raise CheckpointError(f"quantization_config.quant_method={method!r}: loopstack reads FP8 checkpoints "
                              f"({' or '.join(METHODS)}) only; use the unquantized checkpoint")
    block = quant.get("weight_block_size")
    if method == "compressed-tensors":
        for name, group in (quant.get("config_groups") or {}).items():
            weights = group.get("weights") or {}
            if (weights.get("num_bits"), weights.get("type")) != (8, "float"):
                raise CheckpointError(f"compressed-tensors group {name!r} stores {weights.get('num_bits')}-bit "
                                      f"{weights.get('type')} weights; loopstack reads 8-bit float (FP8) only")
            if weights.get("strategy") == "block":
                block = weights.get("block_structure")
    return Fp8Scheme(method, tuple(block) if block else None)


def stored_dtypes(folder: str | Path) -> dict[str, str]:
    """Tensor name -> safetensors dtype string ("F8_E4M3", "BF16", ...) over every weight file."""
    out: dict[str, str] = {}
    for file in safetensors_files(folder):
        with open_safetensors(file) as f:
            out.update({name: f.get_slice(name).get_dtype() for name in f.keys()})
    return out


def _read(folder: str | Path, names: set[str]) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        with open_safetensors(file) as f:
            found.update({n: f.get_tensor(n) for n in names & set(f.keys())})
    return found


def per_channel(weight: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int] | None,
                is_inverse_block: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight: [N, K]` e4m3fn and its stored scale -> (`weight`, `scale: [N]` float32)."""
    from hal.common.kv_quant import quantize

    rows, cols = weight.shape
    scale = scale.float()
    # block-wise first: a block scale [N/bn, K/bk] may hold N values without being per channel
    blocks = None if block_size is None else (-(-rows // block_size[0]), -(-cols // block_size[1]))
    is_block = blocks is not None and tuple(scale.shape) == blocks
    if not is_block and not is_inverse_block and tuple(scale.shape) in ((rows,), (rows, 1)):
        return weight, scale.reshape(rows).contiguous()
    if not is_block and not is_inverse_block and scale.numel() == 1:
        return weight, scale.reshape(1).expand(rows).contiguous()
    if not is_block:
        raise CheckpointError(f"FP8 weight [{rows}, {cols}] has a scale of shape {tuple(scale.shape)}: neither "
                              f"per channel [N], per tensor nor block-wise {list(blocks or ['N/bn', 'K/bk'])} "
                              f"(weight_block_size {list(block_size) if block_size else None})")
    bn, bk = block_size
    full = scale.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]        # [N, K]
    return quantize(weight.float() * full, torch.float8_e4m3fn)


def load_fp8_checkpoint(model: torch.nn.Module, folder: str | Path, dtype: torch.dtype,
                        device: torch.device) -> int:
    """Fill `model` (on the meta device) from a checkpoint whose linears are (partly) FP8; those
    linears become `Fp8Linear`s in e4m3fn. Returns how many."""
    scheme = read_scheme(json.loads((Path(folder) / "config.json").read_text()))
    kinds = stored_dtypes(folder)
    fp8_names = [n[:-len(".weight")] for n, kind in kinds.items() if kind == FP8_STORED and n.endswith(".weight")]
    # the scales are read below, next to their weights; static activation scales are not used
    model.ignored_checkpoint_keys = (*getattr(model, "ignored_checkpoint_keys", ()), *SCALE_SUFFIXES,
                                     *IGNORED_SUFFIXES)
    load_weights(model, folder, dtype, device)
    scale_names = {n + s for n in fp8_names for s in SCALE_SUFFIXES}
    scales = _read(folder, scale_names & set(kinds))
    ignored = sorted({n.rsplit(".", 1)[-1] for n in kinds if n.endswith(IGNORED_SUFFIXES)})
    if ignored:
        log.info("FP8 checkpoint %s: ignoring static %s (activations and KV are scaled on the fly)",
                 Path(folder).name, ", ".join(ignored))
    for name in fp8_names:
        linear = model.get_submodule(name)
        if not isinstance(linear, torch.nn.Linear):
            raise CheckpointError(f"{name}.weight is stored in FP8 but {name} is a {type(linear).__name__}, "
                                  f"not a linear layer")
        key = next((name + s for s in SCALE_SUFFIXES if name + s in scales), None)
        if key is None:
            raise CheckpointError(f"{name}.weight is stored in FP8 without {name}.weight_scale "
                                  f"(or weight_scale_inv): the checkpoint is incomplete")
        weight = linear.weight.detach().to(torch.float8_e4m3fn)          # exact: e4m3 values round-trip
        q, scale = per_channel(weight, scales[key].to(device), scheme.block_size if scheme else None,
                               key.endswith("_inv"))
        fp8 = Fp8Linear(linear.in_features, linear.out_features, bias=False, device="meta")
        fp8.weight, fp8.weight_scale = q, scale
        if linear.bias is not None:
            fp8.bias = torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, fp8)
    if scheme and scheme.block_size:
        log.info("FP8 checkpoint %s: block-wise scales %s requantized per output channel", Path(folder).name,
                 scheme.block_size)
    return len(fp8_names)
