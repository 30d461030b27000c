"""CPU semantics of the Ascend attention and KV ops, from their torch_npu documentation.

Each function takes the op's bound arguments (see `schemas.bind`), checks the documented
constraints the Hal relies on (raising `NpuOpError`, as the NPU would refuse the call), and
computes the result in plain torch. `strict=False` lifts only the hardware shape limits (head dim
128 and fp16/bf16 on the fused TND path) so tiny test models can run through the fused path;
layouts, lengths, block tables, masks and slots are always checked.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from hal.ascend.ops import MASK_SIZE
from hal.attention import dense_attention

FUSED_DTYPES = (torch.float16, torch.bfloat16)


class NpuOpError(RuntimeError):
    """A call the NPU op would reject (wrong layout, lengths, dtype, mask, slots)."""


def require(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise NpuOpError(f"{op}: {message}")


def causal_mask_ok(mask: torch.Tensor | None) -> bool:
    """The compressed right-down causal mask: 2048 x 2048, True (masked) strictly above the diagonal."""
    if mask is None or mask.shape[-2:] != (MASK_SIZE, MASK_SIZE) or mask.dim() > 4:
        return False
    if mask.dtype not in (torch.bool, torch.int8, torch.uint8) or any(s != 1 for s in mask.shape[:-2]):
        return False
    # an inference tensor keeps no version counter, so a change to it cannot be seen: checked every call
    version = None if mask.is_inference() else mask._version
    seen = _VERIFIED.get(id(mask))
    if seen is not None and version is not None and seen[0]() is mask and seen[1] == version:   # unmodified
        return True
    ok = bool(torch.equal(mask.reshape(MASK_SIZE, MASK_SIZE).bool(), _causal_mask(mask.device)))
    if ok and version is not None:
        if len(_VERIFIED) > 64:
            _VERIFIED.clear()
        _VERIFIED[id(mask)] = (weakref.ref(mask), version)
    return ok


_VERIFIED: dict[int, tuple[weakref.ref, int]] = {}      # masks already checked (one per backend)


@functools.lru_cache(maxsize=4)
def _causal_mask(device: torch.device) -> torch.Tensor:
    return torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool, device=device).triu(1)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, kv_len: int, num_kv_heads: int) -> torch.Tensor:
    """Keys or values `[kv_len, KVH, D]` of one sequence from a BnBsH or BnNBsD cache."""
    if cache.dim() == 3:                                         # [nb, bs, KVH * D]
        rows = cache[blocks].reshape(-1, num_kv_heads, cache.shape[-1] // num_kv_heads)
    else:                                                        # [nb, KVH, bs, D]
        rows = cache[blocks].transpose(1, 2).reshape(-1, num_kv_heads, cache.shape[-1])
    return rows[:kv_len]


def fused_infer_attention(a: dict[str, Any], strict: bool) -> tuple[torch.Tensor, torch.Tensor]:
    op = "npu_fused_infer_attention_score"
    q, key, value, table = a["query"], a["key"], a["value"], a["block_table"]
    if a["input_layout"] != "TND" or table is None:
        raise NotImplementedError(f"{op}: the simulation covers input_layout='TND' with a block_table only")
    require(q.dim() == 3, op, f"Layout TND, queryDims({q.dim()}) must be 3")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = a["num_key_value_heads"] or num_heads
    require(a["num_heads"] == num_heads, op, f"num_heads={a['num_heads']} but the query has {num_heads}")
    require(num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= 64, op,
            f"num_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}, ratio <= 64")
    require(key.shape == value.shape and key.dtype == value.dtype == q.dtype, op,
            f"key {tuple(key.shape)} {key.dtype}, value {tuple(value.shape)} {value.dtype}, query {q.dtype}")
    require(q.is_contiguous() and key.is_contiguous() and value.is_contiguous(), op, "inputs: contiguous")
    if key.dim() == 3:
        require(key.shape[2] == num_kv_heads * head_dim, op,
                f"BnBsH cache last dim {key.shape[2]} != num_key_value_heads * D = {num_kv_heads * head_dim}")
    else:
        require(key.dim() == 4 and key.shape[1] == num_kv_heads and key.shape[3] == head_dim, op,
                f"cache: (blocknum, blocksize, H) or (blocknum, KV_N, blocksize, D), not {tuple(key.shape)}")
    block_size = a["block_size"]
    cache_block = key.shape[2] if key.dim() == 4 else key.shape[1]
    require(block_size == cache_block, op, f"block_size={block_size} != the cache's {cache_block}")
    require(0 < block_size <= 512 and block_size % (128 if strict else 16) == 0, op,
            f"block_size={block_size}: page attention takes multiples of 128 up to 512")
    if strict:
        require(q.dtype in FUSED_DTYPES, op, f"query dtype {q.dtype}: the fused op takes float16 or bfloat16")
        require(head_dim == 128, op, f"head dim {head_dim}: the TND path without rope takes D = 128")
    cum = a["actual_seq_lengths"]
    require(cum is not None and len(cum) > 0, op, "TND needs actual_seq_lengths (cumulative query lengths)")
    require(all(x <= y for x, y in zip([0, *cum], cum)) and cum[-1] == num_tokens, op,
            f"actual_seq_lengths {list(cum)} must be non-decreasing, cumulative, ending at T={num_tokens}")
    num_seqs, kv_lens = len(cum), a["actual_seq_lengths_kv"]
    require(kv_lens is not None and len(kv_lens) == num_seqs and min(kv_lens) >= 0, op,
            f"page attention needs actual_seq_lengths_kv per sequence ({num_seqs}), got {kv_lens}")
    require(table.dim() == 2 and table.shape[0] == num_seqs and table.dtype == torch.int32, op,
            f"block_table must be int32 [B={num_seqs}, max_blocks], got {table.dtype} {tuple(table.shape)}")
    require(-(-max(kv_lens) // block_size) <= table.shape[1], op, "block_table narrower than the longest KV")
    if a["sparse_mode"] != 3:
        raise NotImplementedError(f"{op}: the simulation covers sparse_mode=3 (right-down causal) only")
    require(causal_mask_ok(a["atten_mask"]), op, "sparse_mode=3 needs the 2048 x 2048 compressed causal mask "
            "(True above the diagonal)")
    require(not a["softmax_lse_flag"], op, "softmax_lse_flag=True is not simulated")

    out = torch.empty_like(q)
    compute = torch.promote_types(q.dtype, torch.float32)
    for b, (lo, hi) in enumerate(zip([0, *cum], cum)):
        if hi == lo:
            continue
        kv_len = kv_lens[b]
        require(hi - lo <= kv_len, op, f"sparse_mode=3: sequence {b} has {hi - lo} queries but {kv_len} keys")
        blocks = table[b, :-(-kv_len // block_size)].long()
        in_range = bool(((blocks >= 0) & (blocks < key.shape[0])).all())
        require(in_range, op, f"block ids of sequence {b} out of range")
        k = _gather(key, blocks, kv_len, num_kv_heads).transpose(0, 1)[None].to(compute)     # [1, KVH, L, D]
        v = _gather(value, blocks, kv_len, num_kv_heads).transpose(0, 1)[None].to(compute)
        qi = q[lo:hi].transpose(0, 1)[None].to(compute)                                        # [1, H, Q, D]
        out[lo:hi] = dense_attention(qi, k, v, scale=a["scale"], causal=True)[0].transpose(0, 1).to(q.dtype)
    return out, torch.empty(0, dtype=torch.float32, device=q.device)


def fused_infer_attention_antiquant(a: dict[str, Any], strict: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged attention of one query per sequence over int8 caches with per-(token, head) scales
    managed by page (key/value_antiquant_mode 5; the documented Q_S = 1 path)."""
    op = "npu_fused_infer_attention_score (antiquant)"
    q, key, value, table = a["query"], a["key"], a["value"], a["block_table"]
    k_scale, v_scale = a["key_antiquant_scale"], a["value_antiquant_scale"]
    require(a["input_layout"] == "BSH" and q.dim() == 3 and q.shape[1] == 1, op,
            f"the simulation covers BSH with one query per sequence (Q_S = 1), got {a['input_layout']} "
            f"{tuple(q.shape)}")
    require(a["key_antiquant_mode"] == a["value_antiquant_mode"] == 5, op,
            "per-token + per-head scales managed by page: key/value_antiquant_mode 5")
    require(a["antiquant_scale"] is None and a["atten_mask"] is None and a["sparse_mode"] == 0, op,
            "decode with separate K/V scales: no combined antiquant_scale, no mask, sparse_mode 0")
    num_seqs, num_heads = q.shape[0], a["num_heads"]
    num_kv_heads = a["num_key_value_heads"] or num_heads
    head_dim = q.shape[2] // num_heads
    require(q.shape[2] == num_heads * head_dim and num_heads % num_kv_heads == 0, op,
            f"query [B, 1, H * D] with H = num_heads = {num_heads}, a multiple of num_key_value_heads")
    if strict:
        require(q.dtype in FUSED_DTYPES, op, f"query dtype {q.dtype}: float16 or bfloat16")
    require(key.dtype == value.dtype == torch.int8 and key.shape == value.shape and key.dim() == 3
            and key.shape[2] == num_kv_heads * head_dim, op,
            f"caches: int8 (blocknum, blocksize, KVH * D), got {key.dtype} {tuple(key.shape)}")
    num_blocks, block_size = key.shape[:2]
    require(a["block_size"] == block_size and block_size % (32 if strict else 16) == 0 and block_size <= 512, op,
            f"block_size={a['block_size']}: int8 caches take multiples of 32 up to 512, equal to the cache's")
    want = (num_blocks, num_kv_heads, block_size)
    require(all(t is not None and t.dtype == torch.float32 and tuple(t.shape) == want for t in (k_scale, v_scale)),
            op, f"mode 5 scales: float32 (blocknum, KV_N, blocksize) = {want}")
    require(all(t.is_contiguous() for t in (q, key, value, k_scale, v_scale)), op, "inputs: contiguous")
    kv_lens = a["actual_seq_lengths_kv"]
    require(kv_lens is not None and len(kv_lens) == num_seqs and min(kv_lens) > 0, op,
            f"page attention needs actual_seq_lengths_kv per sequence ({num_seqs}), got {kv_lens}")
    require(table.dim() == 2 and table.shape[0] == num_seqs and table.dtype == torch.int32
            and -(-max(kv_lens) // block_size) <= table.shape[1], op, "block_table: int32 [B, max_blocks]")
    out = torch.empty_like(q)
    for b, kv_len in enumerate(kv_lens):
        blocks = table[b, :-(-kv_len // block_size)].long()

        def dequantized(cache: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
            rows = cache[blocks].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()        # [L, KVH, D]
            return rows * scales[blocks].transpose(1, 2).reshape(-1, num_kv_heads)[:kv_len, :, None]
        k = dequantized(key, k_scale).transpose(0, 1)[None]                                 # [1, KVH, L, D]
        v = dequantized(value, v_scale).transpose(0, 1)[None]
        qi = q[b, 0].view(num_heads, head_dim)[None, :, None].float()                     # [1, H, 1, D]
        o = dense_attention(qi, k, v, scale=a["scale"], causal=True)                       # [1, H, 1, D]
        out[b, 0] = o[0, :, 0].reshape(-1).to(q.dtype)
    return out, torch.empty(0, dtype=torch.float32, device=q.device)


def paged_attention(a: dict[str, Any], strict: bool) -> None:
    op = "_npu_paged_attention"
    q, key_cache, value_cache, out = a["query"], a["key_cache"], a["value_cache"], a["out"]
    lens, table = a["context_lens"], a["block_table"]
    require(q.dim() == 3 and out.shape == q.shape and out.dtype == q.dtype, op, "query and out: [B, H, D]")
    num_seqs, num_heads, head_dim = q.shape
    require(a["num_heads"] == num_heads, op, f"num_heads={a['num_heads']} but the query has {num_heads}")
    num_kv_heads = a["num_kv_heads"]
    require(key_cache.dim() == 4 and key_cache.shape[2:] == (num_kv_heads, head_dim)
            and value_cache.shape == key_cache.shape, op,
            f"caches: [num_blocks, block_size, {num_kv_heads}, {head_dim}], not {tuple(key_cache.shape)}")
    require(num_heads % num_kv_heads == 0, op, "num_heads must be a multiple of num_kv_heads")
    if strict:
        require(q.dtype in FUSED_DTYPES, op, f"query dtype {q.dtype}: ATB paged attention takes fp16/bf16")
    require(lens.device.type == "cpu" and lens.dtype == torch.int32 and lens.shape == (num_seqs,), op,
            f"context_lens must be a host int32 tensor [{num_seqs}], got {lens.dtype} on {lens.device}")
    require(table.dim() == 2 and table.shape[0] == num_seqs and table.dtype == torch.int32, op,
            "block_table must be int32 [B, max_blocks]")
    block_size = key_cache.shape[1]
    compute = torch.promote_types(q.dtype, torch.float32)
    for b, kv_len in enumerate(lens.tolist()):
        require(0 < kv_len <= table.shape[1] * block_size, op, f"context_lens[{b}]={kv_len} beyond the table")
        blocks = table[b, :-(-kv_len // block_size)].long()
        k = key_cache[blocks].flatten(0, 1)[:kv_len].transpose(0, 1)[None].to(compute)
        v = value_cache[blocks].flatten(0, 1)[:kv_len].transpose(0, 1)[None].to(compute)
        qi = q[b:b + 1].transpose(0, 1)[None].to(compute)
        out[b] = dense_attention(qi, k, v, scale=a["scale_value"], causal=True)[0, :, 0].to(out.dtype)


def scatter_pa_kv_cache(a: dict[str, Any], strict: bool) -> None:
    op = "npu_scatter_pa_kv_cache"
    key, value, key_cache, value_cache, slots = (a["key"], a["value"], a["key_cache"], a["value_cache"],
                                                 a["slot_mapping"])
    if a["cache_mode"] not in (None, "Norm") or a["compress_lens"] is not None or a["seq_lens"] is not None:
        raise NotImplementedError(f"{op}: the simulation covers cache_mode='Norm' (ND caches), 3-D keys only")
    require(key.dim() == 3 and value.shape[:2] == key.shape[:2], op, "key and value must be [T, N, D]")
    require(key_cache.dim() == 4 and key_cache.shape[2:] == key.shape[1:]
            and value_cache.shape[2:] == value.shape[1:], op,
            f"caches must be [num_blocks, block_size, N, D] matching the keys, got {tuple(key_cache.shape)}")
    require(key.dtype == value.dtype == key_cache.dtype == value_cache.dtype, op, "dtypes must all be equal")
    require(all(t.is_contiguous() for t in (key, value, key_cache, value_cache)), op, "inputs: contiguous")
    require(slots.dtype in (torch.int32, torch.int64) and slots.shape == (key.shape[0],), op,
            f"slot_mapping must be int32/int64 [T={key.shape[0]}], got {slots.dtype} {tuple(slots.shape)}")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    require(bool(((slots >= 0) & (slots < num_slots)).all()), op, f"slots must lie in [0, {num_slots - 1}]")
    require(slots.unique().numel() == slots.numel(), op, "slots must not repeat")
    key_cache.view(num_slots, *key.shape[1:])[slots.long()] = key
    value_cache.view(num_slots, *value.shape[1:])[slots.long()] = value
