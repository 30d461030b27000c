"""Seeded random weights for `zoo.from_config`, drawn so that they do not depend on tensor parallelism.

Every matrix gets its own generator, seeded from the model seed and the parameter's name, and is
drawn whole on the target device; a tensor-parallel rank then keeps only its slice (`ShardSpec`).
So a model built with `tp_size=2` holds exactly the slices of the `tp_size=1` model with the same
seed, and each rank materialises one full tensor at a time, never the whole model. Linear and
embedding weights are normal(0, std); their biases are zero; other parameters get their module's
`reset_parameters()` (RMSNorm: ones) or zeros (Huginn's qk_bias, as its constructor).
"""
from __future__ import annotations

import zlib

import torch
from torch import nn

from zoo.parallel import RowParallelLinear, ShardSpec, VocabParallelEmbedding, VocabParallelHead, read_shard

MATRIX_MODULES = (nn.Linear, nn.Embedding, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)


def tensor_seed(seed: int, name: str) -> int:
    """A stable per-tensor seed (Python's `hash` differs between processes; crc32 does not)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def _draw(name: str, shape: tuple[int, ...], std: float, seed: int, dtype: torch.dtype,
          device: torch.device) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(tensor_seed(seed, name))
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)


def fill_random(model: nn.Module, seed: int, std: float, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every parameter of `model` (built on the meta device, possibly sharded) by a real
    tensor on `device`, drawn as the module docstring says; re-ties tied weights."""
    tp = getattr(model, "tensor_parallel", None)
    specs: dict[str, ShardSpec] = tp.specs if tp is not None else {}
    owners = dict(model.named_modules())
    for name, param in list(model.named_parameters()):
        module_name, _, leaf = name.rpartition(".")
        module = owners[module_name]
        spec = specs.get(name)
        shape = spec.full_shape if spec is not None else tuple(param.shape)
        if isinstance(module, MATRIX_MODULES) and leaf == "weight":
            full = _draw(name, shape, std, seed, dtype, device)
            value = read_shard(lambda index: full[index], spec).clone() if spec is not None else full
        else:
            value = torch.zeros(param.shape, dtype=dtype, device=device)
        setattr(module, leaf, nn.Parameter(value, requires_grad=param.requires_grad))
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if reset is not None and not isinstance(module, MATRIX_MODULES):
            reset()
    if hasattr(model, "tie_weights"):
        model.tie_weights()
