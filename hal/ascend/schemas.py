"""The torch_npu op schemas the Ascend Hal calls, recorded from torch-npu 2.13.0's live dispatcher,
and `bind`, which matches a Python call against one the way the dispatcher does.

The CPU simulation binds every call through these strings, so a misspelled keyword, a keyword-only
argument passed by position or a wrong argument type fails on the CPU exactly where the real op
would refuse it; `hal.ascend.schema_check` (CI, with torch-npu installed) asserts that these
records still equal the live schemas.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

TORCH_NPU_VERSION = "2.13.0"

SCHEMAS: dict[str, str] = {  # op -> schema, exactly as `torch.ops.<ns>.<op>.default._schema` prints it
    "npu_fused_infer_attention_score": (
        "npu::npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, "
        "Tensor? pse_shift=None, Tensor? atten_mask=None, SymInt[]? actual_seq_lengths=None, "
        "SymInt[]? actual_seq_lengths_kv=None, Tensor? dequant_scale1=None, Tensor? quant_scale1=None, "
        "Tensor? dequant_scale2=None, Tensor? quant_scale2=None, Tensor? quant_offset2=None, "
        "Tensor? antiquant_scale=None, Tensor? antiquant_offset=None, Tensor? key_antiquant_scale=None, "
        "Tensor? key_antiquant_offset=None, Tensor? value_antiquant_scale=None, "
        "Tensor? value_antiquant_offset=None, Tensor? block_table=None, Tensor? query_padding_size=None, "
        "Tensor? kv_padding_size=None, Tensor? key_shared_prefix=None, Tensor? value_shared_prefix=None, "
        "SymInt[]? actual_shared_prefix_len=None, Tensor? query_rope=None, Tensor? key_rope=None, "
        "Tensor? key_rope_antiquant_scale=None, int num_heads=1, float scale=1., int pre_tokens=2147483647, "
        "int next_tokens=2147483647, str input_layout=\"BSH\", int num_key_value_heads=0, int sparse_mode=0, "
        "int inner_precise=0, int block_size=0, int antiquant_mode=0, int key_antiquant_mode=0, "
        "int value_antiquant_mode=0, bool softmax_lse_flag=False) -> (Tensor, Tensor)"),
    "npu_scatter_pa_kv_cache": (
        "npu::npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping, *, Tensor? compress_lens=None, "
        "Tensor? compress_seq_offsets=None, Tensor? seq_lens=None, str? cache_mode=\"PA_NZ\") -> ()"),
    "_npu_paged_attention": (
        "atb::_npu_paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, "
        "int num_heads, float scale_value, Tensor block_table, Tensor context_lens, Tensor(a!) out, *, "
        "Tensor? workspace=None) -> ()"),
    "npu_rms_norm": (
        "npu::npu_rms_norm(Tensor input, Tensor gamma, float epsilon=9.9999999999999995e-07) "
        "-> (Tensor, Tensor)"),
    "npu_add_rms_norm": (
        "npu::npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, "
        "float epsilon=9.9999999999999995e-07) -> (Tensor, Tensor, Tensor)"),
    "npu_apply_rotary_pos_emb": (
        "npu::npu_apply_rotary_pos_emb(Tensor query, Tensor key, Tensor cos, Tensor sin, "
        "str layout=\"BSND\", str rotary_mode=\"half\") -> (Tensor, Tensor)"),
    "npu_rotary_mul": (
        "npu::npu_rotary_mul(Tensor input, Tensor r1, Tensor r2, str rotary_mode=\"half\", "
        "Tensor? rotate=None) -> Tensor"),
    "npu_swiglu": (
        "npu::npu_swiglu(Tensor input, int dim=-1) -> Tensor"),
}


class SchemaError(TypeError):
    """A call that the op's schema rejects (the real dispatcher raises RuntimeError/TypeError)."""


@lru_cache(maxsize=None)
def parsed(op: str) -> Any:
    """The parsed `torch._C.FunctionSchema` of `op` (a key of SCHEMAS)."""
    return torch._C.parse_schema(SCHEMAS[op])


def bind(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of `op` by name, defaults filled in, or SchemaError naming the fault."""
    schema = parsed(op)
    arguments = list(schema.arguments)
    positional = [a for a in arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise SchemaError(f"{op}: {len(args)} positional arguments, the schema takes {len(positional)} "
                          f"({', '.join(a.name for a in positional)}); pass the rest by keyword")
    known = {a.name for a in arguments}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise SchemaError(f"{op}: no argument named {', '.join(map(repr, unknown))}; schema: {SCHEMAS[op]}")
    bound: dict[str, Any] = {}
    for a, value in zip(positional, args):
        if a.name in kwargs:
            raise SchemaError(f"{op}: argument {a.name!r} given twice")
        bound[a.name] = value
    for a in arguments:
        if a.name in bound:
            continue
        if a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
        else:
            raise SchemaError(f"{op}: missing value for argument {a.name!r}")
        _check_type(op, a.name, str(a.type), bound[a.name])
    for a, value in zip(positional, args):
        _check_type(op, a.name, str(a.type), value)
    return bound


def _check_type(op: str, name: str, type_str: str, value: Any) -> None:
    optional = type_str.startswith("Optional[")
    base = type_str[len("Optional["):-1] if optional else type_str
    if value is None:
        if not optional:
            raise SchemaError(f"{op}: argument {name!r} ({type_str}) may not be None")
        return
    ok = {
        "Tensor": lambda v: isinstance(v, torch.Tensor),
        "List[Tensor]": lambda v: isinstance(v, (list, tuple)) and all(torch.is_tensor(t) for t in v),
        "List[int]": lambda v: isinstance(v, (list, tuple)) and all(_is_int(t) for t in v),
        "int": _is_int,
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
    }.get(base)
    if ok is None:
        raise SchemaError(f"{op}: argument {name!r} has type {type_str}, which bind() does not know")
    if not ok(value):
        raise SchemaError(f"{op}: argument {name!r} expects {type_str}, got {type(value).__name__}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
