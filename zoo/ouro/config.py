"""Ouro configuration: the keys of the released config.json (model_type "ouro")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zoo.config_fields import check_attention_heads, config_values, rotary_scaling


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
        check_attention_heads(self)
        if self.total_ut_steps < 1:
            raise ValueError(f"total_ut_steps must be >= 1, got {self.total_ut_steps}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "OuroConfig":
        """From a config.json dict; refuses features the released checkpoints do not use rather than
        silently computing something else."""
        scaling = rotary_scaling(raw)
        if scaling is not None:
            raise ValueError(f"{scaling[0]}={raw[scaling[0]]!r} is not supported by zoo.ouro (the released "
                             f"checkpoints use plain rotary embeddings)")
        if raw.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported by zoo.ouro")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={raw['hidden_act']!r} is not supported (Ouro uses silu)")
        return cls(**config_values(cls, raw))
