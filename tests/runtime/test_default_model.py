"""The packaged `ouro-tiny`: `model=ouro-tiny` resolves inside the package, and a bare
`python -m runtime.generate` uses it with a default prompt once the checkpoint is there."""
import pytest
import torch
from hydra import compose, initialize_config_dir

import train_looped as tl
import zoo
import zoo.resolve
from helpers import single_thread  # noqa: F401 (fixture)
from looped_data import train_tokenizer
from runtime import generate

pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = "the sun rises over the sea and the moon sets behind the old hill".split()


@pytest.fixture
def packaged_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(zoo.resolve, "PACKAGED_DIR", tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


def add_tiny_checkpoint(packaged_dir):
    docs = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 4
    cfg = tl.TrainConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, seq_len=64)
    model = zoo.from_config(tl.model_config(cfg, 320), dtype=torch.float32, seed=0)
    return tl.save_checkpoint(model, train_tokenizer(docs, 300), packaged_dir / "ouro-tiny", cfg.seq_len)


def generate_config(*overrides):
    with initialize_config_dir(str(generate.CONF_DIR), version_base="1.3"):
        return compose("generate", overrides=["hal=cpu", "max_tokens=5", "ignore_eos=true", *overrides])


def test_bare_generate_runs_the_packaged_model_on_the_default_prompt(packaged_dir):
    folder = add_tiny_checkpoint(packaged_dir)
    assert zoo.resolve_checkpoint("ouro-tiny") == folder
    (result,) = generate.run(generate_config())
    assert result["prompt"] == generate.DEFAULT_PROMPT and len(result["token_ids"]) == 5
    (named,) = generate.run(generate_config("model=ouro-tiny", "prompt=The moon"))
    assert named["prompt"] == "The moon" and len(named["token_ids"]) == 5


def test_without_the_checkpoint_the_model_list_stays_and_the_name_says_how_to_train(packaged_dir):
    assert generate.default_model() is None
    with pytest.raises(generate.UsageError, match="model.path="):
        generate.run(generate_config())
    with pytest.raises(zoo.CheckpointError, match="examples/train_looped.py"):
        zoo.resolve_checkpoint("ouro-tiny")
