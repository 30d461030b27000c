"""Huginn-0125 configuration: the keys of the released config.json (model_type "huginn_raven")."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from zoo.config_fields import config_values

# config.json keys whose released value is the only one zoo.huginn computes: key -> accepted value
FIXED_CHOICES = {
    "injection_type": "linear",
    "state_init": "like-init",
    "block_class_name": "SandwichBlock",
    "mlp_class_name": "GatedMLP",
    "norm_class_name": "RMSNorm_llama",
    "nonlin_name": "SiLU",
}


@dataclass(frozen=True)
class HuginnConfig:
    vocab_size: int = 65536
    padded_vocab_size: int | None = None     # None: vocab_size; rows of the embedding and head
    n_embd: int = 5280
    n_heads: int = 55
    num_key_value_heads: int | None = None   # None: n_heads
    intermediate_size: int = 17920
    n_layers_in_prelude: int = 2
    n_layers_in_recurrent_block: int = 4
    n_layers_in_coda: int = 2
    block_size: int = 4096                   # positions the model was trained for (its rotary table)
    rope_base: float = 50000.0
    norm_eps: float = 1e-6
    bias: bool = False                       # the adapter's bias (no other layer has one)
    qk_bias: bool = True
    tie_embeddings: bool = True
    mean_recurrence: int = 32
    mean_backprop_depth: int = 8
    init_values: dict[str, float] = field(default_factory=lambda: {
        "std": 0.008703882797784892, "embed_scale": 72.6636084983398})
    test_time_noise: float = 0.0
    bos_token_id: int | None = 65504
    eos_token_id: int | list[int] | None = 65505
    pad_token_id: int | None = 65509
    torch_dtype: str | None = None           # None: the stored tensors' dtype
    model_type: str = "huginn_raven"

    def __post_init__(self) -> None:
        if self.padded_vocab_size is None:
            object.__setattr__(self, "padded_vocab_size", self.vocab_size)
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.n_heads)
        if self.n_embd % self.n_heads:
            raise ValueError(f"n_embd={self.n_embd} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.num_key_value_heads:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.qk_bias and self.num_key_value_heads != self.n_heads:
            raise ValueError("qk_bias=true needs num_key_value_heads == n_heads (the bias has one row per "
                             "query head, as in the reference)")
        if self.mean_recurrence < 1:
            raise ValueError(f"mean_recurrence must be >= 1, got {self.mean_recurrence}")
        for key in ("std", "embed_scale"):
            if key not in self.init_values:
                raise ValueError(f"init_values needs {key!r} (the initial-state std and the embedding scale)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_heads

    @property
    def embed_scale(self) -> float:
        """Multiplies the token embeddings and the random initial state (sqrt(n_embd) when released)."""
        return float(self.init_values["embed_scale"])

    @property
    def init_std(self) -> float:
        """Std of the initial state before `embed_scale`, at `init_scale=1`."""
        return float(self.init_values["std"])

    @property
    def initializer_range(self) -> float:
        """Std for `zoo.from_config`'s random weights (the reference ships no initialiser)."""
        return self.init_std

    @property
    def max_position_embeddings(self) -> int:
        return self.block_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "HuginnConfig":
        """From a config.json dict; refuses variants the released checkpoint does not use rather than
        silently computing something else."""
        for key, accepted in FIXED_CHOICES.items():
            if key in raw and raw[key] != accepted:
                raise ValueError(f"{key}={raw[key]!r} is not supported by zoo.huginn (only {accepted!r})")
        if raw.get("test_time_noise"):
            raise ValueError(f"test_time_noise={raw['test_time_noise']!r} is not supported by zoo.huginn; "
                             f"set it to 0 (the released value)")
        head_dim = raw.get("head_dim")
        if head_dim is not None and head_dim != raw.get("n_embd", 5280) // raw.get("n_heads", 55):
            raise ValueError(f"head_dim={head_dim} must equal n_embd // n_heads (the reference derives it)")
        layers = ("n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda")
        if all(k in raw for k in ("n_layers", *layers)) and raw["n_layers"] != sum(map(raw.get, layers)):
            raise ValueError(f"n_layers={raw['n_layers']} is not prelude + recurrent block + coda")
        values = config_values(cls, raw)
        if "tie_embeddings" not in raw and "tie_word_embeddings" in raw:
            values["tie_embeddings"] = raw["tie_word_embeddings"]
        return cls(**values)
