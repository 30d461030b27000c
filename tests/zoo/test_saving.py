"""`zoo.save_pretrained` writes the layout `zoo.from_pretrained` reads: identical logits back."""
import json

import pytest
import torch
from safetensors import safe_open

import zoo
from helpers import single_thread  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("single_thread")

CONFIG = dict(model_type="ouro", vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, total_ut_steps=3, max_position_embeddings=64,
              rope_theta=10000.0, torch_dtype="float32")


def logits_of(model, ids):
    with torch.no_grad():
        return model(ids, return_step_logits=True).step_logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_gives_identical_logits(tmp_path, dtype):
    model = zoo.from_config(CONFIG, seed=3)
    with torch.no_grad():            # norms and the gate away from their init values
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    zoo.save_pretrained(model, tmp_path, dtype=dtype)
    loaded = zoo.from_pretrained(tmp_path)
    assert next(loaded.parameters()).dtype == dtype                   # config.json's torch_dtype
    ids = torch.randint(0, 96, (2, 9))
    expected = logits_of(model.to(dtype), ids)
    torch.testing.assert_close(logits_of(loaded, ids), expected, atol=0, rtol=0)


def test_config_json_and_file_contents(tmp_path):
    model = zoo.from_config(CONFIG, seed=0)
    zoo.save_pretrained(model, tmp_path / "new" / "folder", dtype="bfloat16")
    config = json.loads((tmp_path / "new" / "folder" / "config.json").read_text())
    assert config["model_type"] == "ouro" and config["architectures"] == ["OuroForCausalLM"]
    assert config["torch_dtype"] == "bfloat16" and config["total_ut_steps"] == 3 and config["head_dim"] == 8
    with safe_open(str(tmp_path / "new" / "folder" / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {f.get_slice(n).get_dtype() for n in names} == {"BF16"}
    assert names == set(model.state_dict())
    assert next(model.parameters()).dtype == torch.float32             # the model itself is untouched


def test_tied_head_is_stored_once_and_tied_again(tmp_path):
    model = zoo.from_config({**CONFIG, "tie_word_embeddings": True}, seed=1)
    zoo.save_pretrained(model, tmp_path, dtype=torch.float32)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    loaded = zoo.from_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, 96, (1, 7))
    torch.testing.assert_close(logits_of(loaded, ids), logits_of(model, ids), atol=0, rtol=0)


def test_sharded_save_loads_and_a_later_single_file_save_replaces_it(tmp_path):
    model = zoo.from_config(CONFIG, seed=2)
    ids = torch.randint(0, 96, (1, 6))
    zoo.save_pretrained(model, tmp_path, dtype=torch.float32, max_shard_bytes=20_000)
    shards = sorted(p.name for p in tmp_path.glob("model-*-of-*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(model.state_dict())
    torch.testing.assert_close(logits_of(zoo.from_pretrained(tmp_path), ids), logits_of(model, ids), atol=0, rtol=0)
    other = zoo.from_config(CONFIG, seed=4)
    zoo.save_pretrained(other, tmp_path, dtype=torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    torch.testing.assert_close(logits_of(zoo.from_pretrained(tmp_path), ids), logits_of(other, ids), atol=0, rtol=0)


def test_a_tensor_parallel_shard_is_not_saved_as_a_checkpoint(tmp_path):
    part = zoo.from_config(CONFIG, dtype="float32", seed=0, tp_rank=0, tp_size=2)
    with pytest.raises(ValueError, match="rank 0's shards of a 2-way tensor-parallel model"):
        zoo.save_pretrained(part, tmp_path / "shard", dtype="float32")
