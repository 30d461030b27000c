"""Rotary + KV write of a prompt without context, as two launches (the rotary op, then the cache
write reading k and v again) and as one (`rotary_kv_write(keep_kv=True)`, which also hands back the
rotated k the fresh attention reads, and v as a view of the projection or copied), alone and
followed by cuDNN's attention: microseconds per layer-plane on the GPU.

    PYTHONPATH=. python tools/fresh_rotary_bench.py [--tokens 8192 --heads 16 --head-dim 128]
"""
from __future__ import annotations

import argparse

import torch

from hal.kernels import fresh
from hal.kernels.backend import TritonPagedAttention
from hal.kernels.kv_write import write_kv
from hal.kernels.ops import rotary
from hal.kernels.rotary_kv import rotary_kv_write


def time_us(fn, repeats: int = 96) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    tokens, heads, dim, page = args.tokens, args.heads, args.head_dim, 16
    device = torch.device("cuda")
    backend = TritonPagedAttention(heads, heads, dim, torch.bfloat16, device, page)
    qkv = torch.randn(tokens, 3 * heads, dim, device=device, dtype=torch.bfloat16)    # one projection's views
    q, k, v = qkv[:, :heads], qkv[:, heads:2 * heads], qkv[:, 2 * heads:]
    num_blocks = -(-tokens // page)
    cache = torch.zeros(backend.kv_cache_shape(num_blocks), dtype=torch.bfloat16, device=device)
    slots = (torch.randperm(num_blocks, device=device).repeat_interleave(page) * page
             + torch.arange(page, device=device).repeat(num_blocks))[:tokens]
    positions = torch.arange(tokens, device=device)
    configs = backend.configs

    def two_launches() -> None:
        q_rot, k_rot = rotary(q, k, positions, 1e4, False, configs)
        write_kv(k_rot, v, cache, slots, configs["kv_write"])

    def one_launch(copy_v: bool) -> None:
        rotary_kv_write(q, k, v, positions, 1e4, False, cache, slots, configs["rotary"], keep_kv=True, copy_v=copy_v)

    def with_attention(copy_v: bool) -> None:      # what a layer-plane of the 8k prefill runs (lever 101)
        q_rot, k_rot, v_kept = rotary_kv_write(q, k, v, positions, 1e4, False, cache, slots, configs["rotary"],
                                               keep_kv=True, copy_v=copy_v)
        fresh.attention("cudnn", q_rot, k_rot, v_kept, starts, [tokens], dim ** -0.5)

    starts = torch.tensor([0, tokens], device=device, dtype=torch.int32)
    cases = (("rotary, then write_kv", two_launches),
             ("rotary_kv_write, v view", lambda: one_launch(False)),
             ("rotary_kv_write, v copied", lambda: one_launch(True)),
             ("+ cuDNN attention, v view", lambda: with_attention(False)),
             ("+ cuDNN attention, v copied", lambda: with_attention(True)))
    for name, fn in cases * 2:
        print(f"{name:<28} {time_us(fn):8.1f} us per layer-plane ({tokens} tokens x {heads} heads x {dim})")
    if not fresh.takes_cudnn("cudnn", [tokens], heads, heads):      # "cudnn" fell back to flash: say so
        print(f"note: the attention rows ran torch's flash kernel, not cuDNN (fewer than {fresh.CUDNN_MIN_TOKENS} "
              f"tokens, or cuDNN refused: {fresh._cudnn_refused[:1]})")


if __name__ == "__main__":
    main()
