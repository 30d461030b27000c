"""What the families' config classes share: reading a released config.json into a frozen dataclass.

    values = config_values(OuroConfig, raw)        # the dataclass's own keys, and the renamed ones
    scaling = rotary_scaling(raw)                  # ("rope_scaling", "yarn") where a config scales rotary

Why one place: transformers 5 moved `rope_theta` into `rope_parameters` and writes `dtype` for
`torch_dtype`, and each family must read both layouts the same way.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

ROTARY_KEYS = ("rope_scaling", "rope_parameters")     # rope_parameters: transformers 5's layout


def config_values(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    """The entries of `raw` that are fields of the dataclass `cls`, with `rope_theta` taken from
    `rope_parameters` and `torch_dtype` from `dtype` where the config writes them there."""
    names = {f.name for f in fields(cls)}
    values = {k: v for k, v in raw.items() if k in names}
    rope = raw.get("rope_parameters")
    if "rope_theta" in names and "rope_theta" not in values and isinstance(rope, dict) and "rope_theta" in rope:
        values["rope_theta"] = rope["rope_theta"]
    if "torch_dtype" in names and "torch_dtype" not in values and "dtype" in raw:
        values["torch_dtype"] = raw["dtype"]
    return values


def rotary_scaling(raw: dict[str, Any]) -> tuple[str, Any] | None:
    """`(key, kind)` of the first rotary scaling that `raw` asks for (a type other than "default"), or
    None for plain rotary embeddings."""
    for key in ROTARY_KEYS:
        rope = raw.get(key)
        kind = (rope.get("type") or rope.get("rope_type")) if isinstance(rope, dict) else rope
        if kind not in (None, "default"):
            return key, kind
    return None


def check_attention_heads(cfg: Any) -> None:
    """Derive `head_dim` (hidden_size // num_attention_heads) where the config leaves it out, and refuse
    query heads that do not group evenly over the KV heads. For `__post_init__` of a frozen dataclass."""
    if cfg.head_dim is None:
        object.__setattr__(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
                         f"num_key_value_heads={cfg.num_key_value_heads}")
