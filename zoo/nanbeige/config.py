"""Nanbeige4.2 configuration: the keys of the released config.json (model_type "nanbeige")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zoo.config_fields import check_attention_heads, config_values, rotary_scaling

# optional features of the Nanbeige remote code that the released 4.2-3B checkpoint leaves off:
# config key -> why it is refused when a config turns it on
UNSUPPORTED_FLAGS = {
    "enable_hyper_connection": "hyper-connections",
    "enable_mhc": "manifold-constrained hyper-connections (mHC)",
    "qk_layernorm": "q/k layer norms",
    "attention_bias": "attention biases",
    "mlp_bias": "MLP biases",
    "skip_loop_final_norm": "skipping the final norm between loops",
    "enable_double_loop_split": "LoopSplit layer order",
    "loop_share_kv": "KV shared across loops",
    "enable_depth_attention": "depth attention",
    "mhc_diff_for_loop": "mHC loop variants",
    "ngram_insert_all_layers": "n-gram layer fusion",
}
NGRAM_KEYS = ("emb_neighbor_num", "emb_split_num", "ngram_vocab_size_ratio")


def check_supported(raw: dict[str, Any]) -> None:
    """Raise a ValueError naming the key when a config asks for a feature zoo.nanbeige does not
    compute, instead of silently running a different model."""
    def refuse(key: str, what: str) -> None:
        raise ValueError(f"config key {key}={raw[key]!r} turns on {what}, which zoo.nanbeige does not "
                         f"implement (the released Nanbeige4.2-3B leaves it off); remove the key or turn "
                         f"it off")

    for key, what in UNSUPPORTED_FLAGS.items():
        if raw.get(key):
            refuse(key, what)
    if raw.get("loop_loss_weights"):
        refuse("loop_loss_weights", "per-loop losses (which also change the loop count to len + 1)")
    if raw.get("num_residual_streams", 1) not in (1, None):
        refuse("num_residual_streams", "several residual streams (hyper-connections)")
    if raw.get("mhc_double_stream_position_for_loop") is not None:
        refuse("mhc_double_stream_position_for_loop", "mHC loop variants")
    if raw.get("insert_ngram_layer_idx"):
        refuse("insert_ngram_layer_idx", "n-gram layer fusion")
    if all(raw.get(k) is not None for k in NGRAM_KEYS):        # the reference's own condition
        refuse("emb_neighbor_num", "n-gram embeddings")
    if raw.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"activation {raw['hidden_act']!r} (Nanbeige uses silu)")
    scaling = rotary_scaling(raw)
    if scaling is not None:
        refuse(scaling[0], f"{scaling[1]!r} rotary scaling")


@dataclass(frozen=True)
class NanbeigeConfig:
    vocab_size: int = 166144
    hidden_size: int = 3072
    intermediate_size: int = 10752
    num_hidden_layers: int = 22
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int | None = None            # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 262144
    rope_theta: float = 70_000_000.0
    rms_norm_eps: float = 1e-5
    num_loops: int = 2
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 166100
    eos_token_id: int | list[int] | None = 166101
    pad_token_id: int | None = 0
    torch_dtype: str | None = None         # None: the stored tensors' dtype
    model_type: str = "nanbeige"

    def __post_init__(self) -> None:
        check_attention_heads(self)
        if self.num_loops < 1:
            raise ValueError(f"num_loops must be >= 1, got {self.num_loops}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "NanbeigeConfig":
        check_supported(raw)
        return cls(**config_values(cls, raw))
