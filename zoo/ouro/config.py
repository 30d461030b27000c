"""Ouro configuration: the keys of the released config.json (model_type "ouro")."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class OuroConfig:
    vocab_size: int = 49152
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None            # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 65536
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    total_ut_steps: int = 4
    early_exit_threshold: float = 1.0
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
    pad_token_id: int | None = 0
    torch_dtype: str | None = None     # None: the stored tensors' dtype
    model_type: str = "ouro"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.total_ut_steps < 1:
            raise ValueError(f"total_ut_steps must be >= 1, got {self.total_ut_steps}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "OuroConfig":
        """From a config.json dict; refuses features the released checkpoints do not use rather than
        silently computing something else."""
        for key in ("rope_scaling", "rope_parameters"):       # rope_parameters: transformers 5's layout
            rope = raw.get(key)
            kind = (rope.get("type") or rope.get("rope_type")) if isinstance(rope, dict) else rope
            if kind not in (None, "default"):
                raise ValueError(f"{key}={rope!r} is not supported by zoo.ouro (the released checkpoints "
                                 f"use plain rotary embeddings)")
        if raw.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported by zoo.ouro")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={raw['hidden_act']!r} is not supported (Ouro uses silu)")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        rope = raw.get("rope_parameters")
        if "rope_theta" not in values and isinstance(rope, dict) and "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        if "torch_dtype" not in values and "dtype" in raw:
            values["torch_dtype"] = raw["dtype"]
        return cls(**values)
