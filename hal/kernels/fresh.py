"""Causal attention of prefill chunks that have no prior context, on their freshly computed K/V
through torch's vendor kernels, instead of the paged Triton kernel reading them back from the cache.

Why: such a chunk attends only to itself, so K and V are already contiguous in the projection's
output, where a vendor's kernel may beat the paged Triton kernel. The cache is still written (by
`write_kv`), for the decode steps that follow. Only prompts of at least `MIN_TOKENS` come here (the
backend's `fresh_min_tokens`); shorter ones, and on Hopper every batch cuDNN does not take, attend over
their own K/V on the paged kernel (`TritonMeta.own_kv`). Measured on an H100 (docs/performance.md lever
138, one layer-plane at Ouro-1.4B's heads with the cache write): cuDNN 29.9 / 67.7 / 522 us at 1,024 /
2,048 / 8,192 tokens, the paged kernel over the prompt's own K/V 34.4 / 90.9 / 749, varlen flash
47.2 / 126.2 / 988 (and eight 1,024-token prompts: own K/V 187, flash 226).

Modes (the Hal chooses; hal/ never tests the vendor here):
  "flash"  every sequence of the batch in one varlen call of `aten::_flash_attention_forward`
           (cumulative query offsets = the metadata's `query_start_loc`): CUDA builds of torch
  "sdpa"   `scaled_dot_product_attention(is_causal=True)` per sequence (torch picks its fastest
           backend): ROCm builds, and the CPU where tests check the routing
  "cudnn"  one prompt with as many KV heads as query heads only (`takes`), through cuDNN's fused
           attention in SDPA: on Hopper faster than flash and the paged kernel at every length measured
           (levers 28, 138); a first refusal (a torch without it, an unsupported shape) sends every
           later call to "flash"
All take 16-bit q/k/v only; float32 (golden and conformance runs) stays on the Triton kernel.

Over an 8-bit cache the chunk attends over what the cache holds, not its exact K/V: the quantizing
write hands back K and V dequantized from its own bytes and scales in the same launch
(`kv_write.write_kv(dequantize=True)`, equal to `kv_quant.fake_quantize`), so the chunk sees the keys
later chunks and decode steps read from the cache. The product of value and scale is rounded to the
16-bit dtype (2^-9 relative) where the paged kernel keeps it in fp32; FP8's own rounding (2^-4) is
what the error budget of docs/fp8.md measures.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

MODES = ("flash", "cudnn", "sdpa")
DTYPES = (torch.bfloat16, torch.float16)
# The shortest prompt that takes the fresh path (the backend's default): the short captured buckets
# below it replay the paged kernel over their own K/V, faster than flash there (levers 78, 135-136)
MIN_TOKENS = 1024
MAX_SDPA_SEQS = 16                # "sdpa" launches once per sequence: more go to the paged kernel
CUDNN_MIN_TOKENS = 1024           # shorter prompts in "cudnn" run flash (only where min_tokens lets them in)
_cudnn_refused: list[str] = []    # why cuDNN attention failed once (then "cudnn" runs as "flash")


def _flash_varlen(*args, **kwargs):
    # (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
    #  *, scale): the same positional schema from torch 2.3 to 2.13; GQA (KVH divides H) is native
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def usable(mode: str | None, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether prefill without context may take `mode` for this backend's shape."""
    return mode in MODES and dtype in DTYPES and head_dim % 8 == 0 and head_dim <= 256


def takes(mode: str | None, query_lens: Sequence[int], seq_lens: Sequence[int], min_tokens: int,
          num_heads: int, num_kv_heads: int) -> bool:
    """Whether a batch goes to the fresh path: every sequence is a prefill chunk without prior
    context (query_len == seq_len), its longest has at least `min_tokens` tokens (the backend's, past
    any decode-like batch), and in "cudnn" it is one prompt of as many KV heads as heads (cuDNN's own;
    the paged kernel over their own K/V beat flash at every length measured). Captured prefills take
    this path where their capacity says `fresh`."""
    if mode not in MODES or len(query_lens) == 0 or max(query_lens) < min_tokens:
        return False
    if mode == "sdpa" and len(query_lens) > MAX_SDPA_SEQS:
        return False
    if mode == "cudnn" and (len(query_lens) > 1 or num_heads != num_kv_heads):
        return False
    return without_context(query_lens, seq_lens)


def without_context(query_lens: Sequence[int], seq_lens: Sequence[int]) -> bool:
    """Whether every sequence of a batch is a prompt chunk without prior context (query_len == seq_len)."""
    return all(q == s for q, s in zip(query_lens, seq_lens))


def takes_cudnn(mode: str | None, query_lens: Sequence[int], num_heads: int, num_kv_heads: int) -> bool:
    """Whether `attention` hands this batch to cuDNN (one long prompt whose heads are all KV heads;
    it attends as fast over v as a view of the q|k|v projection as over a copy: lever 101)."""
    return (mode == "cudnn" and len(query_lens) == 1 and query_lens[0] >= CUDNN_MIN_TOKENS
            and num_heads == num_kv_heads and not _cudnn_refused)


def attention(mode: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
              query_lens: Sequence[int], scale: float) -> torch.Tensor:
    """Causal attention of packed sequences over themselves: q `[T, H, D]`, k and v `[T, KVH, D]`,
    `query_start_loc: [S + 1]` int32 (device), `query_lens` the same on the host. Returns `[T, H, D]`."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if takes_cudnn(mode, query_lens, q.shape[1], k.shape[1]):
        out = _cudnn(q, k, v, scale)
        if out is not None:
            return out
    if mode in ("flash", "cudnn"):
        max_len = max(query_lens)
        return _flash_varlen(q, k, v, query_start_loc, query_start_loc, max_len, max_len, 0.0, True, False,
                             scale=scale)[0]
    out = torch.empty_like(q)
    start = 0
    for n in query_lens:        # [T, H, D] -> [1, H, T, D] views, one causal SDPA per sequence
        qs, ks, vs = (t[start:start + n].transpose(0, 1)[None] for t in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                             enable_gqa=q.shape[1] != k.shape[1])
        out[start:start + n] = y[0].transpose(0, 1)
        start += n
    return out


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """One sequence `[T, H, D]` through SDPA restricted to cuDNN's backend, or None (and never again)
    where that backend refuses."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            y = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                scale=scale)
    except (RuntimeError, AttributeError) as exc:
        _cudnn_refused.append(str(exc))
        return None
    return y[0].transpose(0, 1)
