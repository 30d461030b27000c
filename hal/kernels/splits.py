"""Flash-decoding's context split, shared by the decode attention kernels: how many programs share
one (sequence, KV head)'s keys, the buffers their partial results go to, and the reduce that merges
them.

A split program writes its unnormalised output row, its running maximum (log2 domain) and its
running sum for each query row it owns; `_reduce_splits_kernel` rescales every split's partial to the
common maximum and divides by the merged sum. Splits that saw no keys write a maximum of -inf and
weigh nothing.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hal.kernels.configs import KernelConfig
from hal.kernels.launch import Launch, launch_options, next_pow2
from hal.kernels.pdl import pdl_wait

SPLITS_ENV = "LOOPSTACK_MAX_SPLITS"


def _max_splits(text: str) -> int:
    """The split cap `LOOPSTACK_MAX_SPLITS` asks for: a power of two from 1 to 16."""
    if text.strip() in ("1", "2", "4", "8", "16"):
        return int(text)
    raise ValueError(f"{SPLITS_ENV}={text!r}: give a power of two from 1 to 16 (16, the default, "
                     f"when unset)")


# context splits per (sequence, KV head) at most; the environment may lower it for an experiment
# (tools/gpu_check.sh splits4; runtime.bench records the setting in its rows)
MAX_SPLITS = _max_splits(os.environ.get(SPLITS_ENV, "16"))


def num_kv_splits(num_seqs: int, num_kv_heads: int, num_compute_units: int) -> int:
    """Context splits per (sequence, KV head) for a decode-like batch: enough programs for about
    two per compute unit. Depends only on numbers fixed per graph bucket, not on context lengths."""
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = -(-2 * num_compute_units // programs)
    return min(next_pow2(wanted), MAX_SPLITS)


def split_parts(q: torch.Tensor, num_splits: int, head_dim_pad: int) -> list[torch.Tensor]:
    """(partial outputs `[S, T, H, D_pad]`, maxima `[S, T, H]`, sums `[S, T, H]`), float32; empty
    placeholders without a split (the kernels never touch them then)."""
    if num_splits == 1:
        return [q.new_empty(0, dtype=torch.float32)] * 3
    num_tokens, num_heads = q.shape[:2]
    return [q.new_empty(num_splits, num_tokens, num_heads, head_dim_pad, dtype=torch.float32),
            q.new_empty(num_splits, num_tokens, num_heads, dtype=torch.float32),
            q.new_empty(num_splits, num_tokens, num_heads, dtype=torch.float32)]


@triton.jit
def split_tiles(num_tiles, split, NUM_SPLITS: tl.constexpr):
    """Key tiles [tile_lo, tile_hi) of context split `split`: its share of the sequence's `num_tiles`."""
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * tiles_per_split
    return tile_lo, tl.minimum(tile_lo + tiles_per_split, num_tiles)


@triton.jit(do_not_specialize=["num_tokens"])        # a step's size (hal/kernels/launch.py)
def _reduce_splits_kernel(out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, num_tokens, stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          SPLITS_PAD: tl.constexpr, PDL: tl.constexpr = False):
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    part_row = (splits * num_tokens + token) * num_heads + head                # [S]
    m = tl.load(part_max_ptr + part_row, mask=split_valid, other=float("-inf"))
    l = tl.load(part_sum_ptr + part_row, mask=split_valid, other=0.0)
    m_all = tl.max(m, 0)
    weight = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))        # empty splits weigh 0
    denom = tl.sum(weight * l, 0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    parts = tl.load(part_out_ptr + part_row[:, None] * HEAD_DIM_PAD + dims[None, :],
                    mask=split_valid[:, None], other=0.0)                      # [S, D]
    out = tl.sum(parts * weight[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def reduce_launch(out: torch.Tensor, parts: list[torch.Tensor], config: KernelConfig, target: str) -> Launch:
    """The launch merging `parts` (from `split_parts`) into `out` `[T, H, D]`."""
    num_splits, num_tokens, num_heads, head_dim_pad = parts[0].shape
    return Launch(_reduce_splits_kernel, (num_tokens, num_heads), (
        out, *parts, num_tokens, out.stride(0), out.stride(1)), dict(
        HEAD_DIM=out.shape[2], HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=num_splits,
        SPLITS_PAD=max(next_pow2(num_splits), 2), **launch_options(config, target)))
