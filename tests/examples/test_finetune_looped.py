"""examples/finetune_looped.py and tools/install_finetuned.py: the objective, the choice of weights,
the data it reads, and a fine-tune end to end whose output is installed as a packaged checkpoint."""
import json
import os
import shutil
import subprocess
import sys

import finetune_looped as ft
import install_finetuned as inst
import pytest
import torch
import train_looped as tl
from evaluate_looped import HeldoutResult
from helpers import ROOT, single_thread  # noqa: F401 (fixture)
from looped_data import (
    EOS_ID,
    TOKEN_FILES,
    epoch_windows,
    read_token_file,
    read_tokens,
    subset_tokens,
    tokenize_corpus,
)
from test_train_looped import write_corpus

import zoo
from zoo.training import expected_exit_loss

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def token_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ft")
    tokenize_corpus(write_corpus(folder / "corpus", num_docs=400), folder / "tokens", vocab_size=300)
    return folder / "tokens"


def test_subset_keeps_whole_random_documents_and_the_heldout_split(token_folder, tmp_path):
    full = read_token_file(token_folder / TOKEN_FILES["train"])
    manifest = subset_tokens(token_folder, tmp_path / "sub", train_tokens=full.numel() // 2, seed=1)
    sub = read_token_file(tmp_path / "sub" / TOKEN_FILES["train"])
    assert full.numel() // 2 <= sub.numel() < full.numel() // 2 + 200 and int(sub[-1]) == EOS_ID
    docs = lambda ids: [tuple(d.tolist()) for d in torch.tensor_split(ids, (ids == EOS_ID).nonzero()[:, 0] + 1)[:-1]]
    assert set(docs(sub)) <= set(docs(full)) and len(docs(sub)) == manifest["files"]["train.u16.xz"]["documents"]
    assert docs(sub) != docs(full)[: len(docs(sub))]                          # drawn at random, not a prefix
    assert (tmp_path / "sub" / "valid.u16.xz").read_bytes() == (token_folder / "valid.u16.xz").read_bytes()
    assert manifest["tokenizer_sha256"] == ft.sha256_file(token_folder / "tokenizer.json")


def test_epoch_windows_see_every_token_once_an_epoch():
    tokens = torch.arange(1000)
    batches = epoch_windows(tokens, batch_size=3, seq_len=10, generator=torch.Generator().manual_seed(0))
    first = torch.cat([next(batches) for _ in range(33)])                   # 99 or 100 windows an epoch: 33 batches
    assert first.shape == (99, 10) and len(set(first.flatten().tolist())) == 990
    assert torch.equal(first[:, 1:] - first[:, :-1], torch.ones(99, 9, dtype=torch.long))


def test_objective_trains_loops_by_fixed_weights_and_only_the_gate_by_the_expected_loss():
    torch.manual_seed(0)
    logits = torch.randn(4, 2, 6, 11, requires_grad=True)
    pdf = torch.softmax(torch.randn(2, 6, 4), -1).requires_grad_()
    ids = torch.randint(0, 11, (2, 6))
    weights = ft.parse_loop_weights("1,2,3,4", 4)
    out = ft.depth_objective(logits, pdf, ids, weights, gate_entropy_weight=0.05)
    gate = expected_exit_loss(logits, pdf, ids, entropy_weight=0.05).loss
    assert out.loss.item() == pytest.approx((weights * out.step_losses).sum().item() + gate.item(), rel=1e-6)
    out.loss.backward()
    alone = logits.detach().requires_grad_()
    (weights * ft.step_cross_entropy(alone, ids).mean((1, 2))).sum().backward()
    torch.testing.assert_close(logits.grad, alone.grad)                      # the gate term moves no logits
    assert pdf.grad.abs().sum() > 0
    with pytest.raises(SystemExit):
        ft.parse_loop_weights("1,2,3", 4)


def result(losses, exit_loss, exit_loops=3.2):
    exits = {"0.5": {"mean_loops": exit_loops, "loss": exit_loss, "fraction_by_loops": [0, 0.1, 0.6, 0.3]}}
    return HeldoutResult(losses, exits, [0.0, 0.2, 0.4, 0.4], 100)


def test_selection_prefers_the_acceptance_then_the_order_then_the_last_loss():
    accepted = result([3.3, 2.9, 2.85, 2.849], 2.85)
    ordered_far_gate = result([3.3, 2.9, 2.85, 2.80], 2.85)                  # the gate's loss 0.05 off
    unordered = result([3.3, 2.9, 2.91, 2.7], 2.7)                           # loop 3 worse than loop 2
    equal_at_4_decimals = result([3.3, 2.9, 2.85001, 2.84999], 2.85)
    keys = {name: ft.selection_key(r) for name, r in
            [("accepted", accepted), ("ordered", ordered_far_gate), ("unordered", unordered),
             ("equal", equal_at_4_decimals)]}
    assert keys["accepted"][0] == 0 and keys["ordered"][0] == 1 and keys["unordered"][0] == 2
    assert keys["equal"][0] == 2                                           # the docs print 4 decimals
    assert min(keys, key=keys.get) == "accepted"
    assert ft.acceptance(result([3.3, 2.9, 2.85, 2.84], 2.84, exit_loops=4.0))["exit_0.5_mean_below_full"] is False


def test_pick_finetuned_keeps_the_run_of_the_best_rule_then_the_lowest_loss(tmp_path, capsys):
    """tools/pick_finetuned.py: of several runs, $OUT/ft gets the files of the one whose kept weights
    meet the first selection rule (then the lowest loss(S)); the others' reports go beside it."""
    import pick_finetuned

    runs = {"ft-0": (2, [3.1, 2.8, 2.81, 2.70]),           # the lowest loss(4), but loop 3 is worse than loop 2
            "ft-1": (0, [3.1, 2.8, 2.79, 2.785]), "ft-2": (0, [3.1, 2.8, 2.79, 2.78])}
    for name, (rule, losses) in runs.items():
        (tmp_path / name).mkdir()
        report = {"selection": ft.SELECTION_RULES[rule], "heldout_loss_by_loops": dict(enumerate(losses, 1)),
                  "config": {"loop_weights": "1,1,1,7", "lr": 3e-4}, "selected_step": 9}
        (tmp_path / name / "finetune.json").write_text(json.dumps(report))
        (tmp_path / name / "model.safetensors").write_text(name)
    out = tmp_path / "out"
    sys.argv = ["pick_finetuned.py", "--out", str(out), *(str(tmp_path / n) for n in runs)]
    pick_finetuned.main()
    assert (out / "ft" / "model.safetensors").read_text() == "ft-2"
    assert sorted(p.name for p in out.iterdir()) == ["ft", "ft-0.json", "ft-1.json"]
    assert "kept ft-2" in capsys.readouterr().out


def tiny_checkpoint(token_folder, folder):
    tokenizer, _, _ = read_tokens(token_folder, torch.device("cpu"))
    cfg = tl.TrainConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, seq_len=32,
                         tie_embeddings=True)
    model = zoo.from_config(tl.model_config(cfg, 320), dtype=torch.float32, seed=5)
    tl.save_checkpoint(model, tokenizer, folder, cfg.seq_len)
    shutil.copyfile(token_folder / "tokenizer.json", folder / "tokenizer.json")
    return folder


def test_finetune_end_to_end_then_install(token_folder, tmp_path):
    init = tiny_checkpoint(token_folder, tmp_path / "init")
    out = tmp_path / "OUT" / "ft"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_looped.py"), "--init", str(init),
                           "--tokens", str(token_folder), "--out", str(out), "--weights-only", "--device", "cpu",
                           "--max-steps", "6", "--eval-every", "2", "--eval-start", "3", "--batch-size", "4", "--shard-mb", "0.02",
                           "--eval-batch-size", "16", "--log-every", "2", "--throughput-batches", "1", "--lr", "3e-3"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "finetune.json").read_text())
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) >= 2 and not (out / "config.json").exists()          # --weights-only, under --shard-mb
    assert sorted(report["weight_files"]) == [p.name for p in shards]
    assert [e["step"] for e in report["history"]["eval"]] == [0, 4, 6]             # none before --eval-start
    assert report["steps"] == 6 and report["tokens"] == 6 * 4 * 32
    assert list(report["heldout_loss_by_loops"]) == ["1", "2", "3", "4"]
    assert set(report["exit_by_threshold"]) == {"0.3", "0.5", "0.7", "0.9"}
    assert report["selection"] in ft.SELECTION_RULES and report["selected_step"] in (0, 4, 6)
    assert list(report["tokens_per_s_by_loops"]) == ["1", "2", "3", "4"]
    kept = next(e for e in report["history"]["eval"] if e["step"] == report["selected_step"])
    assert kept["loss_by_loops"] == pytest.approx([report["heldout_loss_by_loops"][k] for k in "1234"], abs=1e-4)

    # the tokenizer must be the checkpoint's
    other = tmp_path / "other"
    shutil.copytree(init, other)
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + "\n")      # another file
    bad = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_looped.py"), "--init", str(other),
                          "--tokens", str(token_folder), "--out", str(tmp_path / "bad"), "--max-steps", "1",
                          "--device", "cpu"], env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "another tokenizer" in bad.stderr

    # install: one model.safetensors, the docs' blocks and the metrics rewritten
    packaged = tmp_path / "packaged"
    shutil.copytree(init, packaged)
    report["init_weights_sha256"] = {p.name: inst.sha256(p) for p in packaged.glob("*.safetensors")}
    (out / "finetune.json").write_text(json.dumps(report))
    docs, metrics = tmp_path / "card.md", tmp_path / "metrics.json"
    docs.write_text("# card\n" + "".join(f"<!-- generated:{n} -->\nOLDBODY\n<!-- /generated:{n} -->\ntext\n"
                                         for n in inst.RENDERERS))
    old = {"heldout_loss_by_loops": {"1": 3.4, "2": 2.9, "3": 2.85, "4": 2.857}, "heldout_tokens": 5,
           "mean_exit_loops": {"0.5": 3.1}, "mean_exit_pdf": [0.1, 0.2, 0.3, 0.4],
           "exit_by_threshold": {"0.5": {"mean_loops": 3.1, "loss": 2.85, "fraction_by_loops": [0, 0, 1, 0]}},
           "cpu_check": {"losses": [1, 2]}, "steps": 1617}
    metrics.write_text(json.dumps(old))
    args = [str(out), "--checkpoint", str(packaged), "--docs", str(docs), "--metrics", str(metrics),
            "--plot", str(tmp_path / "depth.png")]
    if report["selection"].startswith("acceptance"):
        pytest.skip("a tiny model met the acceptance: the refusal is not exercised")
    assert inst.main(args) == 1                                              # misses the acceptance: refused
    assert inst.main([*args, "--force", "--dry-run"]) == 0
    assert json.loads(metrics.read_text()) == old and "OLDBODY" in docs.read_text()
    assert inst.main([*args, "--force"]) == 0
    assert not list(packaged.glob("model-*")) and (packaged / "model.safetensors").is_file()
    from safetensors.torch import load_file

    installed = load_file(str(packaged / "model.safetensors"))
    for shard in out.glob("*.safetensors"):
        for name, tensor in load_file(str(shard)).items():
            assert torch.equal(installed[name], tensor)
    new = json.loads(metrics.read_text())
    assert new["heldout_loss_by_loops"] == report["heldout_loss_by_loops"]
    assert new["before_finetune"]["heldout_loss_by_loops"] == old["heldout_loss_by_loops"]
    assert new["finetune"]["selected_step"] == report["selected_step"] and new["steps"] == 1617
    assert "stale" in new["cpu_check"]["weights"]
    text = docs.read_text()
    assert "OLDBODY" not in text and text.count("text\n") == 4
    assert f"{report['heldout_loss_by_loops']['4']:.4f}" in text and "Before the fine-tune" in " ".join(text.split())
    assert inst.main([*args, "--force"]) == 0                                # again: the first "before" stays
    assert json.loads(metrics.read_text())["before_finetune"] == new["before_finetune"]


def test_the_model_card_is_rendered_from_its_metrics_file():
    docs = (ROOT / "docs" / "ouro-tiny.md").read_text()
    metrics = json.loads((ROOT / "docs" / "ouro-tiny-metrics.json").read_text())
    assert {m["name"] for m in inst.BLOCK.finditer(docs)} == set(inst.RENDERERS)
    assert inst.render_blocks(docs, metrics) == docs
