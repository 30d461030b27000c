"""Every torch_npu op call the Ascend Hal makes, in one place, so the implementation can be swapped.

Each call site is a small wrapper `fn(lib, ...)` registered in `CALL_SITES`. `lib` is what provides
the ops: the real `torch_npu` module on an NPU, a `SimNpu` (hal/ascend/sim/: the CPU simulation of
exactly these ops) in tests, or `torch_npu` fed meta tensors in the CI schema check. The rest of
the Hal calls them through an `AscendOps` bound to one lib, which counts calls per site (so the
checker can prove it covered them all) and keeps the capture log graphs need.

A site is *updatable* when `torch.npu.NPUGraph.update(cpu_update_input=...)` can replace some of
its host arguments in a captured graph (`update_keys`); torch_npu 2.13 registers such handlers for
fused-infer attention and ATB paged attention only.
"""
from __future__ import annotations

import collections
from typing import Any, Callable, NamedTuple

import torch

MASK_SIZE = 2048                 # sparse_mode 2/3/4 take a fixed 2048 x 2048 causal mask


class CallSite(NamedTuple):
    name: str                       # wrapper name, the key in CALL_SITES
    op: str                         # the torch_npu function it calls (a key of schemas.SCHEMAS)
    fn: Callable[..., Any]          # fn(lib, ...)
    update_keys: tuple[str, ...]    # host arguments a graph update replaces; () = not updatable
    has_meta_kernel: bool           # False for ATB ops: the CI check can bind their schema only


CALL_SITES: dict[str, CallSite] = {}


def call_site(op: str, update_keys: tuple[str, ...] = (), has_meta_kernel: bool = True):
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        CALL_SITES[fn.__name__] = CallSite(fn.__name__, op, fn, update_keys, has_meta_kernel)
        return fn
    return register


# ----- attention ------------------------------------------------------------------------------
@call_site("npu_fused_infer_attention_score", update_keys=("actual_seq_lengths", "actual_seq_lengths_kv"))
def fused_infer_attention(lib: Any, query: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, *, atten_mask: torch.Tensor, block_table: torch.Tensor,
                          cum_query_lens: list[int], kv_lens: list[int], num_heads: int, num_kv_heads: int,
                          scale: float, block_size: int) -> torch.Tensor:
    """Right-down causal attention of packed queries `[T, H, D]` (TND) over the paged cache
    `key_cache, value_cache: [num_blocks, block_size, KVH * D]` (BnBsH). `cum_query_lens: [B]`
    cumulative, `kv_lens: [B]` per sequence, `block_table: [B, max_blocks]` int32, `atten_mask`
    the 2048 x 2048 compressed causal mask that sparse_mode 3 takes. Returns `[T, H, D]`."""
    out, _ = lib.npu_fused_infer_attention_score(
        query, key_cache, value_cache, atten_mask=atten_mask, block_table=block_table,
        actual_seq_lengths=cum_query_lens, actual_seq_lengths_kv=kv_lens, num_heads=num_heads,
        num_key_value_heads=num_kv_heads, scale=scale, input_layout="TND", sparse_mode=3,
        block_size=block_size)
    return out


@call_site("npu_fused_infer_attention_score", update_keys=("actual_seq_lengths_kv",))
def fused_infer_attention_int8(lib: Any, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                               *, key_scales: torch.Tensor, value_scales: torch.Tensor, block_table: torch.Tensor,
                               kv_lens: list[int], num_heads: int, num_kv_heads: int, scale: float,
                               block_size: int) -> torch.Tensor:
    """One query per sequence `[B, H, D]` (BSH, S = 1) over int8 caches `key_cache, value_cache:
    [num_blocks, block_size, KVH * D]` whose float32 scales `key_scales, value_scales: [num_blocks,
    KVH, block_size]` hold one scale per (token, KV head): antiquant mode 5 ("per-token + per-head,
    scales managed by page attention"), which the op takes for Q_S = 1 only. Returns `[B, H, D]`."""
    batch, heads, head_dim = query.shape
    out, _ = lib.npu_fused_infer_attention_score(
        query.reshape(batch, 1, heads * head_dim), key_cache, value_cache, block_table=block_table,
        actual_seq_lengths_kv=kv_lens, num_heads=num_heads, num_key_value_heads=num_kv_heads, scale=scale,
        input_layout="BSH", block_size=block_size, key_antiquant_scale=key_scales,
        value_antiquant_scale=value_scales, key_antiquant_mode=5, value_antiquant_mode=5)
    return out.view(batch, heads, head_dim)


@call_site("_npu_paged_attention", update_keys=("context_lens",), has_meta_kernel=False)
def paged_decode_attention(lib: Any, query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, *, block_table: torch.Tensor,
                           context_lens: torch.Tensor, num_heads: int, num_kv_heads: int, scale: float,
                           out: torch.Tensor) -> torch.Tensor:
    """One query per sequence `[B, H, D]` over `key_cache, value_cache: [num_blocks, block_size,
    KVH, D]`; `context_lens: [B]` int32 on the *host*; writes `out: [B, H, D]` and returns it."""
    lib._npu_paged_attention(query=query, key_cache=key_cache, value_cache=value_cache,
                             num_kv_heads=num_kv_heads, num_heads=num_heads, scale_value=scale,
                             block_table=block_table, context_lens=context_lens, out=out)
    return out


@call_site("npu_scatter_pa_kv_cache")
def scatter_kv(lib: Any, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store `key, value: [T, KVH, D]` (contiguous) at `slot_mapping: [T]` (every slot valid) of
    `key_cache, value_cache: [num_blocks, block_size, KVH, D]` in place (the ND "Norm" layout)."""
    lib.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, cache_mode="Norm")


# ----- fused small ops ------------------------------------------------------------------------
@call_site("npu_rms_norm")
def rms_norm(lib: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * weight` over the last dim; weight in x's dtype."""
    y, _rstd = lib.npu_rms_norm(x, weight, epsilon=eps)
    return y


@call_site("npu_add_rms_norm")
def add_rms_norm(lib: Any, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)`."""
    y, _rstd, x_sum = lib.npu_add_rms_norm(x, residual, weight, epsilon=eps)
    return y, x_sum


@call_site("npu_apply_rotary_pos_emb")
def rotary_qk(lib: Any, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX rotary of `q: [1, T, H, D]`, `k: [1, T, KVH, D]` (BSND) with `cos, sin: [1, T, 1, D]`
    in q's dtype, in one kernel. The kernel updates q and k in place and returns them."""
    return lib.npu_apply_rotary_pos_emb(q, k, cos, sin, layout="BSND", rotary_mode="half")


@call_site("npu_rotary_mul")
def rotary_one(lib: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: str) -> torch.Tensor:
    """Rotary of one tensor `x: [1, T, N, D]` (BSND) with `cos, sin: [1, T, 1, D]` already laid out
    for `mode` ("half": halves repeated; "interleave": every angle twice in a row)."""
    return lib.npu_rotary_mul(x, cos, sin, rotary_mode=mode)


@call_site("npu_swiglu")
def swiglu(lib: Any, x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :n]) * x[..., n:]` for `x: [..., 2n]`."""
    return lib.npu_swiglu(x, dim=-1)


# ----- binding --------------------------------------------------------------------------------
class GraphCall(NamedTuple):
    """One updatable call recorded while a graph was being captured."""

    site: str                       # call-site name
    owner: Any                      # the attention backend that made it
    plane: int                      # its KV plane
    host_params: dict[str, Any]     # the host arguments it was captured with (update_keys only)


class AscendOps:
    """The call sites bound to one `lib`. `ops.fused_infer_attention(...)` runs that wrapper."""

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.counts: collections.Counter[str] = collections.Counter()
        self.capture_log: list[GraphCall] | None = None     # set by a graph while it captures

    def __getattr__(self, name: str) -> Callable[..., Any]:
        site = CALL_SITES.get(name)
        if site is None:
            raise AttributeError(f"no Ascend call site {name!r}; known: {', '.join(sorted(CALL_SITES))}")

        def call(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return site.fn(self.lib, *args, **kwargs)
        return call

    @property
    def capturing(self) -> bool:
        return self.capture_log is not None

    def record(self, site: str, owner: Any, plane: int, host_params: dict[str, Any]) -> None:
        """Note an updatable call made during capture (the backend calls this right after it)."""
        if self.capture_log is not None:
            expected = CALL_SITES[site].update_keys
            if tuple(host_params) != expected:
                raise ValueError(f"{site}: host params {sorted(host_params)} != update keys {list(expected)}")
            self.capture_log.append(GraphCall(site, owner, plane, host_params))
