"""Checkpoint loading: sharded files, strict name/shape checks, pickle refusal, model names."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from helpers import golden_case
from zoo.resolve import CheckpointError, resolve_checkpoint


@pytest.fixture
def ouro_dir(tmp_path):
    src = golden_case("ouro-tiny").path
    dst = tmp_path / "ouro"
    dst.mkdir()
    shutil.copy(src / "config.json", dst)
    shutil.copy(src / "model.safetensors", dst)
    return dst


def _logits(model):
    with torch.no_grad():
        return model(torch.tensor([[1, 2, 3, 4]])).logits


def test_sharded_checkpoint_matches_single_file(ouro_dir, tmp_path):
    weights = load_file(str(ouro_dir / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(ouro_dir / "config.json", sharded)
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: weights[k] for k in keys}, str(sharded / file))
        weight_map.update({k: file for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = zoo.from_pretrained(ouro_dir), zoo.from_pretrained(sharded)
    torch.testing.assert_close(_logits(a), _logits(b), atol=0, rtol=0)


def test_dtype_by_name_and_default(ouro_dir):
    assert zoo.from_pretrained(ouro_dir).lm_head.weight.dtype == torch.float32   # stored dtype
    assert zoo.from_pretrained(ouro_dir, dtype="bfloat16").lm_head.weight.dtype == torch.bfloat16
    assert zoo.from_pretrained(ouro_dir, dtype=torch.float16).lm_head.weight.dtype == torch.float16
    assert zoo.as_dtype("auto") is None                # vLLM's and transformers' "the checkpoint's"
    assert zoo.from_pretrained(ouro_dir, dtype="auto").lm_head.weight.dtype == torch.float32
    config = json.loads((ouro_dir / "config.json").read_text())
    (ouro_dir / "config.json").write_text(json.dumps({**config, "torch_dtype": "auto"}))
    assert zoo.from_pretrained(ouro_dir).lm_head.weight.dtype == torch.float32    # declares nothing
    for bad in ("float13", "int8", torch.complex64, "float8_e4m3fn"):      # only dtypes a model computes in
        with pytest.raises(ValueError, match="is not one a model computes in"):
            zoo.from_pretrained(ouro_dir, dtype=bad)


def test_missing_unexpected_and_mismatched_names_are_listed(ouro_dir):
    weights = load_file(str(ouro_dir / "model.safetensors"))
    del weights["model.norm.weight"]
    weights["model.extra.weight"] = torch.zeros(3)
    weights["lm_head.weight"] = torch.zeros(7, 64)
    save_file(weights, str(ouro_dir / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        zoo.from_pretrained(ouro_dir)
    text = str(err.value)
    assert "missing (1): model.norm.weight" in text
    assert "unexpected (1): model.extra.weight" in text
    assert "lm_head.weight: file (7, 64) vs model (128, 64)" in text


def test_rotary_buffers_in_file_are_ignored(ouro_dir):
    weights = load_file(str(ouro_dir / "model.safetensors"))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(weights, str(ouro_dir / "model.safetensors"))
    zoo.from_pretrained(ouro_dir)


def test_tied_weights_accepted_once_or_twice(ouro_dir):
    config = json.loads((ouro_dir / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (ouro_dir / "config.json").write_text(json.dumps(config))
    weights = load_file(str(ouro_dir / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, str(ouro_dir / "model.safetensors"))                 # stored twice
    model = zoo.from_pretrained(ouro_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    del weights["lm_head.weight"]
    save_file(weights, str(ouro_dir / "model.safetensors"))                 # stored once
    assert zoo.from_pretrained(ouro_dir).lm_head.weight is not None


def test_pickle_checkpoints_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "ouro"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(CheckpointError, match="safetensors only"):
        zoo.from_pretrained(tmp_path)


def test_code_in_checkpoint_folder_is_never_run(ouro_dir):
    (ouro_dir / "modeling_ouro.py").write_text("raise SystemExit('remote code ran')\n")
    config = json.loads((ouro_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"}
    (ouro_dir / "config.json").write_text(json.dumps(config))
    zoo.from_pretrained(ouro_dir)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="not in the zoo"):
        zoo.from_pretrained(tmp_path)


def test_known_name_absent_from_cache_says_how_to_download(tmp_path):
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint("ouro-1.4b", cache_dir=tmp_path)
    assert "huggingface-cli download ByteDance/Ouro-1.4B" in str(err.value)
    assert "model.path=" in str(err.value)


def test_unknown_name(tmp_path):
    with pytest.raises(CheckpointError, match="not a known model name"):
        resolve_checkpoint("no-such-model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the trigger is a CUDA device missing")
def test_an_error_of_the_device_is_not_called_a_corrupt_file():
    with pytest.raises(Exception) as error:
        zoo.from_pretrained(golden_case("ouro-tiny").path, device="cuda")
    assert "corrupt" not in str(error.value) and "download the checkpoint again" not in str(error.value)


def test_a_missing_relative_folder_is_named_beside_the_hub_id(tmp_path, monkeypatch):
    """`ckpts/ouro` reads as a hub id and as a relative path: the error names the folder looked for."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=f"no folder '{tmp_path}/ckpts/ouro'"):
        resolve_checkpoint("ckpts/ouro", cache_dir=tmp_path / "hub")
