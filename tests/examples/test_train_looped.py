"""examples/train_looped.py: schedule and budget, the saved checkpoint, and a run end to end."""
import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch

import prepare_corpus
import train_looped as tl
import zoo
from evaluate_looped import evaluate
from helpers import ROOT, single_thread  # noqa: F401 (fixture)
from looped_data import (EOS_ID, SPECIAL_TOKENS, encode_documents, heldout_windows, read_corpus, read_token_file,
                         read_tokens, tokenize_corpus, train_tokenizer)
from looped_optim import Budget, learning_rate
from runtime import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("single_thread")

WORDS = ("the quick brown fox jumps over lazy dog and cat sees a red ball near old river "
         "while my friend finds some bread under moon").split()


def write_corpus(folder, num_docs=240, seed=0):
    """A small corpus in prepare_corpus.py's format: sentences of WORDS, one to four per document."""
    rng = random.Random(seed)
    docs = [" ".join(" ".join(rng.choices(WORDS, k=rng.randint(4, 9))).capitalize() + "."
                     for _ in range(rng.randint(1, 4))) for _ in range(num_docs)]
    folder.mkdir(parents=True, exist_ok=True)
    prepare_corpus.write_split(folder / "train.txt", docs[: -num_docs // 8])
    prepare_corpus.write_split(folder / "valid.txt", docs[-num_docs // 8:])
    return folder


TINY_ARGS = ["--batch-size", "4", "--seq-len", "32", "--vocab-size", "300", "--hidden-size", "32",
             "--intermediate-size", "64", "--num-layers", "1", "--num-heads", "2", "--num-loops", "4",
             "--warmup-steps", "5", "--eval-every", "10", "--log-every", "5", "--lr", "3e-3"]


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = tl.TrainConfig(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1)
    assert learning_rate(cfg, 0, 0.0) == pytest.approx(1e-4)
    assert learning_rate(cfg, 9, 0.01) == pytest.approx(1e-3)
    assert learning_rate(cfg, 50, 0.5) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert learning_rate(cfg, 99, 1.0) == pytest.approx(1e-4)


def test_budget_is_the_nearest_of_steps_epochs_and_clock():
    cfg = tl.TrainConfig(max_minutes=0, max_steps=100, max_epochs=2.0)
    budget = Budget(cfg, time.time(), tokens_per_epoch=1000)
    assert budget.progress(10, 1000) == pytest.approx(0.5)         # epochs lead
    assert budget.progress(80, 1000) == pytest.approx(0.8)         # steps lead
    timed = Budget(tl.TrainConfig(max_minutes=1.0, reserve_seconds=0), time.time() - 50, 1000)
    timed.clock_start = time.time() - 40                             # 40 s of 50 left to the deadline
    assert timed.progress(1, 0) == pytest.approx(0.8, abs=0.02)
    assert Budget(tl.TrainConfig(max_minutes=1.0), time.time() - 61, 1000).progress(0, 0) == 1.0


def test_entropy_weight_decays_geometrically_then_stays():
    cfg = tl.TrainConfig(entropy_weight=0.05, entropy_weight_start=1.0, entropy_anneal=0.5)
    assert tl.depth_entropy_weight(cfg, 0.0) == pytest.approx(1.0)
    assert tl.depth_entropy_weight(cfg, 0.25) == pytest.approx((1.0 * 0.05) ** 0.5)
    assert tl.depth_entropy_weight(cfg, 0.5) == pytest.approx(0.05)
    assert tl.depth_entropy_weight(cfg, 0.9) == pytest.approx(0.05)
    assert tl.depth_entropy_weight(tl.TrainConfig(entropy_weight=0.05), 0.0) == 0.05     # no start: constant


def test_token_folder_round_trips_ids_and_tokenizer(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    manifest = tokenize_corpus(corpus, tmp_path / "tokens", vocab_size=300)
    tokenizer, data, again = read_tokens(tmp_path / "tokens", torch.device("cpu"))
    docs = read_corpus(corpus)
    assert torch.equal(data.valid, encode_documents(tokenizer, docs.valid))
    assert data.train.numel() == manifest["files"]["train.u16.xz"]["tokens"] == again["files"]["train.u16.xz"]["tokens"]
    assert data.train.dtype == torch.long and int(data.train[-1]) == EOS_ID
    assert torch.equal(read_token_file(tmp_path / "tokens" / "train.u16.xz"), data.train)



def test_token_folder_made_again_with_a_given_tokenizer_is_identical(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    first = tokenize_corpus(corpus, tmp_path / "tokens", vocab_size=300)
    again = tokenize_corpus(corpus, tmp_path / "again", vocab_size=0, tokenizer_file=tmp_path / "tokens" / "tokenizer.json")
    assert again["files"] == first["files"]                                   # same ids, same xz bytes
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (tmp_path / "tokens" / "tokenizer.json").read_bytes()

def test_exit_histogram_and_exit_loss_agree_with_the_per_token_rule():
    cfg = tl.TrainConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, seq_len=16)
    model = zoo.from_config(tl.model_config(cfg, 64), dtype=torch.float32, seed=3)
    windows = torch.randint(1, 64, (6, 16), generator=torch.Generator().manual_seed(0))
    result = evaluate(model, windows, batch_size=4, thresholds=(0.5, 1.0))
    for q, exit in result.exits.items():
        assert sum(exit["fraction_by_loops"]) == pytest.approx(1.0)
        out = model(windows, exit_threshold=float(q) if float(q) < 1 else None)
        ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), windows[:, 1:].flatten())
        assert exit["loss"] == pytest.approx(ce.item(), rel=1e-5)
    assert result.exits["1.0"]["fraction_by_loops"] == [0.0, 0.0, 0.0, 1.0]     # q=1: the last loop always
    assert result.exits["1.0"]["loss"] == pytest.approx(result.loss_by_loops[-1], rel=1e-6)


def test_arguments_map_onto_the_config_and_need_a_budget():
    cfg = tl.parse_args(["--max-steps", "7", "--no-progress", "--compile", "--lr", "2e-3"])
    assert (cfg.max_steps, cfg.progress, cfg.compile, cfg.lr) == (7, False, True, 2e-3)
    with pytest.raises(SystemExit):
        tl.parse_args(["--max-minutes", "0", "--max-epochs", "0"])


def test_saved_checkpoint_loads_with_identical_logits_and_generates_text(tmp_path):
    corpus = read_corpus(write_corpus(tmp_path / "corpus"))
    tokenizer = train_tokenizer(corpus.train, 300)
    assert [tokenizer.id_to_token(i) for i in range(3)] == list(SPECIAL_TOKENS)
    assert tokenizer.get_vocab_size() <= 300
    cfg = tl.TrainConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, seq_len=32)
    model = zoo.from_config(tl.model_config(cfg, 320), dtype=torch.float32, seed=5)
    folder = tl.save_checkpoint(model, tokenizer, tmp_path / "ck", cfg.seq_len)
    loaded = zoo.from_pretrained(folder)
    assert next(loaded.parameters()).dtype == torch.bfloat16
    ids = encode_documents(tokenizer, corpus.valid[:3])[None, :30]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model.to(torch.bfloat16)(ids).logits, atol=0, rtol=0)
    llm = LLM(str(folder), hal="cpu")
    assert llm.tokenizer.eos_token_id == EOS_ID
    out = llm.generate("The quick", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.text == llm.tokenizer.decode(out.token_ids)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and "{{ message['content'] }}" in config["chat_template"]


def test_example_runs_end_to_end_on_the_cpu(tmp_path):
    corpus = write_corpus(tmp_path / "corpus")
    out, report = tmp_path / "ouro-tiny", tmp_path / "report"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "train_looped.py"), "--corpus", str(corpus),
                           "--out", str(out), "--report", str(report), "--max-steps", "30", "--device", "cpu", "--shard-mb", "0.03",
                           "--no-progress", "--tie-embeddings", "--entropy-weight-start", "0.5", *TINY_ARGS],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((report / "metrics.json").read_text())
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    betas = [r["entropy_weight"] for r in metrics["history"]["train"]]
    assert betas[0] == pytest.approx(0.5, rel=0.1) and betas[-1] == pytest.approx(0.05)   # the depth schedule
    assert metrics["steps"] == 30 and metrics["tokens"] == 30 * 4 * 32
    losses = metrics["heldout_loss_by_loops"]
    assert list(losses) == ["1", "2", "3", "4"] and all(0 < v < 6 for v in losses.values())
    exits = metrics["mean_exit_loops"]
    assert 1 <= exits["0.3"] <= exits["0.5"] <= exits["0.9"] <= 4
    assert list(metrics["tokens_per_s_by_loops"]) == ["1", "2", "3", "4"]
    assert [e["step"] for e in metrics["history"]["eval"]] == [10, 20, 30]
    assert metrics["history"]["eval"][-1]["loss_by_loops"][0] < 5.0         # it learned (ln 320 = 5.77)
    assert set(metrics["samples"]) == set(tl.SAMPLE_PROMPTS)
    assert len(list(out.glob("model-*-of-*.safetensors"))) >= 2          # --shard-mb: under a transfer limit
    # the numbers in the report are those of the shipped checkpoint
    model = zoo.from_pretrained(out, dtype="float32")
    from tokenizers import Tokenizer

    tokens = encode_documents(Tokenizer.from_file(str(out / "tokenizer.json")), read_corpus(corpus).valid)
    again = evaluate(model, heldout_windows(tokens, 32), batch_size=64)
    assert again.loss_by_loops == pytest.approx([losses[k] for k in "1234"], abs=2e-4)
