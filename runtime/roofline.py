"""Roofline floors for a looped model: the fewest bytes a step must move and the FLOPs it must do.

A decode step reads every loop weight once per loop, the embedding rows and head once, and every
running sequence's KV at every plane and layer; a prefill is bounded by its matmul and attention
FLOPs. The floor of a step is the larger of bytes / bandwidth and FLOPs / matmul rate.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from runtime.kv_cache import num_request_planes
from zoo.base import LoopedCausalLM
from zoo.parallel import rank_heads

H200_BANDWIDTH = 4.27e12          # bytes/s, device-to-device copy measured on the H200 (read + write)


class Floor(NamedTuple):
    bytes: float
    flops: float
    seconds_memory: float
    seconds_compute: float

    @property
    def seconds(self) -> float:
        return max(self.seconds_memory, self.seconds_compute)

    @property
    def bound(self) -> str:
        return "memory" if self.seconds_memory >= self.seconds_compute else "compute"


def _numel(modules: list[nn.Module]) -> int:
    seen, total = set(), 0
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


class ModelCosts(NamedTuple):
    loop_params: int            # weights applied once per loop
    once_params: int            # weights applied once per token (prelude/coda blocks), head excluded
    head_params: int            # the LM head (applied to sampled tokens only)
    kv_bytes_per_token: int     # all planes and layers, for one token
    attn_flops_per_ctx: int     # attention FLOPs per (query token, context token) over all layers/loops
    dtype_bytes: int


def model_costs(model: LoopedCausalLM, num_loops: int, kv_mode: str = "full") -> ModelCosts:
    loop = model.loop_modules()
    head = [m for name, m in model.named_children() if name == "lm_head"]
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    loop_ids = {id(p) for m in loop for p in m.parameters()}
    skip = loop_ids | {id(p) for m in head + embeddings for p in m.parameters()}
    once = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    dtype_bytes = next(model.parameters()).element_size()
    spec = model.kv_spec
    num_heads, num_kv_heads = rank_heads(model)        # per GPU under tensor parallelism
    kv_layers = model.num_kv_layers(num_request_planes(kv_mode, spec.num_fixed_planes, num_loops))
    kv_bytes = kv_layers * 2 * num_kv_heads * spec.head_dim * dtype_bytes
    attn_calls = model.num_kv_layers(num_request_planes("full", spec.num_fixed_planes, num_loops))
    attn_flops = attn_calls * 4 * num_heads * spec.head_dim      # QK^T and PV, 2 FLOPs each
    return ModelCosts(_numel(loop), once, _numel(head), kv_bytes, attn_flops, dtype_bytes)


def decode_floor(costs: ModelCosts, num_loops: int, batch: int, context_len: int,
                 bandwidth: float = H200_BANDWIDTH, matmul_rate: float = 700e12) -> Floor:
    """One decode step of `batch` sequences with `context_len` tokens of history each."""
    weights = (costs.loop_params * num_loops + costs.once_params + costs.head_params) * costs.dtype_bytes
    kv = batch * (context_len + 1) * costs.kv_bytes_per_token       # read the history, write the new token
    flops = 2 * batch * (costs.loop_params * num_loops + costs.once_params + costs.head_params)
    flops += batch * context_len * costs.attn_flops_per_ctx
    return Floor(weights + kv, flops, (weights + kv) / bandwidth, flops / matmul_rate)


def prefill_floor(costs: ModelCosts, num_loops: int, prompt_len: int, num_seqs: int = 1,
                  bandwidth: float = H200_BANDWIDTH, matmul_rate: float = 700e12) -> Floor:
    """Prefill of `num_seqs` prompts of `prompt_len` tokens (causal attention: half the square)."""
    tokens = prompt_len * num_seqs
    flops = 2 * tokens * (costs.loop_params * num_loops + costs.once_params) + 2 * num_seqs * costs.head_params
    flops += num_seqs * (prompt_len * (prompt_len + 1) // 2) * costs.attn_flops_per_ctx
    weights = (costs.loop_params * num_loops + costs.once_params + costs.head_params) * costs.dtype_bytes
    bytes_moved = weights + tokens * costs.kv_bytes_per_token
    return Floor(bytes_moved, flops, bytes_moved / bandwidth, flops / matmul_rate)


def measure_matmul_rate(device: torch.device, dtype: torch.dtype, size: int = 8192, repeats: int = 10) -> float:
    """FLOP/s of one large square matmul on random data (the compute ceiling for the floors)."""
    import time

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * size**3 * repeats / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    from hal.registry import for_device

    hal = for_device(device)
    if hasattr(hal, "synchronize"):
        hal.synchronize()
