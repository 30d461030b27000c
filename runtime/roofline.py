"""Roofline floors for a looped model: the fewest bytes a step must move and the FLOPs it must do.

A decode step reads every loop weight once per loop, the embedding rows and head once, and every
running sequence's KV at every plane and layer; a prefill is bounded by its matmul and attention
FLOPs. The floor of a step is the larger of bytes / bandwidth and FLOPs / matmul rate.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from hal.base import Hal
from torch import nn

from runtime.engine.planes import PlaneLayout
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


def _weights(module: nn.Module) -> list[tuple[torch.Tensor, bool]]:
    """(tensor, is a weight) for what a forward reads: parameters, and FP8 linears' weight and scale
    buffers (zoo/fp8.py; the scales count as bytes, not as multiply-adds)."""
    out = [(p, True) for p in module.parameters()]
    for sub in module.modules():
        if hasattr(sub, "weight_scale") and not isinstance(sub.weight, nn.Parameter):
            out += [(sub.weight, True), (sub.weight_scale, False)]
    return out


def _count(modules: list[nn.Module], skip: set[int] = frozenset()) -> tuple[int, int]:
    """(weight elements, bytes) of the modules, each tensor once."""
    seen, numel, nbytes = set(skip), 0, 0
    for module in modules:
        for t, is_weight in _weights(module):
            if id(t) not in seen:
                seen.add(id(t))
                numel, nbytes = numel + t.numel() * is_weight, nbytes + t.numel() * t.element_size()
    return numel, nbytes


class ModelCosts(NamedTuple):
    loop_params: int            # weights applied once per loop
    once_params: int            # weights applied once per token (prelude/coda blocks), head excluded
    head_params: int            # the LM head (applied to sampled tokens only)
    kv_bytes_per_token: int     # all planes and layers, for one token
    attn_flops_per_ctx: int     # attention FLOPs per (query token, context token) over all layers/loops
    loop_bytes: int             # bytes of the loop weights (FP8 linears: 1 byte per weight plus scales)
    once_bytes: int
    head_bytes: int


def model_costs(model: LoopedCausalLM, num_loops: int, kv_mode: str = "full",
                kv_bytes_per_layer_token: int | None = None) -> ModelCosts:
    """`kv_bytes_per_layer_token`: K and V bytes one token takes in one layer (an 8-bit cache's
    values with their scales); None: the model dtype's `2 * KVH * D` elements."""
    loop = model.loop_modules()
    head = [m for name, m in model.named_children() if name == "lm_head"]
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    skip = {id(t) for m in loop + head + embeddings for t, _ in _weights(m)}
    once, once_bytes = _count([model], skip)
    spec = model.kv_spec
    num_heads, num_kv_heads = rank_heads(model)        # per GPU under tensor parallelism
    if kv_bytes_per_layer_token is None:
        kv_bytes_per_layer_token = 2 * num_kv_heads * spec.head_dim * next(model.parameters()).element_size()
    kv_layers = model.num_kv_layers(PlaneLayout(kv_mode, spec.num_fixed_planes).num_planes(num_loops))
    attn_calls = model.num_kv_layers(spec.num_planes(num_loops))       # every loop attends, whatever it keeps
    attn_flops = attn_calls * 4 * num_heads * spec.head_dim      # QK^T and PV, 2 FLOPs each
    (loop_n, loop_b), (head_n, head_b) = _count(loop), _count(head)
    for t in model.step_weights_of_loop_modules():          # read once per step, though in a loop module
        loop_n, loop_b = loop_n - t.numel(), loop_b - t.numel() * t.element_size()
        once, once_bytes = once + t.numel(), once_bytes + t.numel() * t.element_size()
    return ModelCosts(loop_n, once, head_n, kv_layers * kv_bytes_per_layer_token, attn_flops, loop_b,
                      once_bytes, head_b)


def _weight_bytes(costs: ModelCosts, num_loops: int) -> int:
    return costs.loop_bytes * num_loops + costs.once_bytes + costs.head_bytes


def decode_floor(costs: ModelCosts, num_loops: int, batch: int, context_len: int,
                 bandwidth: float = H200_BANDWIDTH, matmul_rate: float = 700e12) -> Floor:
    """One decode step of `batch` sequences with `context_len` tokens of history each."""
    weights = _weight_bytes(costs, num_loops)
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
    bytes_moved = _weight_bytes(costs, num_loops) + tokens * costs.kv_bytes_per_token
    return Floor(bytes_moved, flops, bytes_moved / bandwidth, flops / matmul_rate)


def measure_copy_rate(hal: Hal, num_bytes: int = 1 << 28, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy, read and write counted (how the H200's 4.27 TB/s was
    measured): the bandwidth ceiling of the device this runs on, which need not be an H200. 256 MiB
    is five times an H100's or H200's L2 and fits beside a bench cell's KV pool (10% of memory)."""
    import time

    device = torch.device(hal.device())
    if device.type == "cpu":      # the host's memory: a smaller copy says as much, and sooner
        num_bytes, repeats = min(num_bytes, 1 << 26), min(repeats, 3)
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    hal.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    hal.synchronize()
    return 2 * num_bytes * repeats / (time.perf_counter() - start)


def measure_matmul_rate(hal: Hal, dtype: torch.dtype, size: int = 8192, repeats: int = 10) -> float:
    """FLOP/s of one large square matmul on random data on the Hal's device (the compute ceiling for
    the floors)."""
    import time

    device = torch.device(hal.device())
    warmups = 3
    if device.type == "cpu":      # bf16 on a CPU without AMX runs at about 1 GFLOP/s: 1024^3 took 45 s
        size, warmups, repeats = min(size, 512), 1, min(repeats, 3)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=hal.device(), dtype=dtype)
    for _ in range(warmups):
        a @ b
    hal.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    hal.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start)
