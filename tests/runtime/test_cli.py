"""`python -m runtime.generate`: the golden continuation, clear errors, nothing written to the cwd."""
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT, golden_case
from zoo.loading import packaged_checkpoint


def run_cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "runtime.generate", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["ouro-tiny", "ouro-tiny-gqa-bf16"])
def test_prints_golden_continuation(name, tmp_path):
    case = golden_case(name)
    ids = case.prompt(0)
    n = case.meta["greedy_new_tokens"]
    proc = run_cli("hal=cpu", f"model.path={case.path}", f"prompt_ids=[{','.join(map(str, ids))}]",
                   f"max_tokens={n}", "temperature=0", "model.dtype=float32", "ignore_eos=true", "output=json",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == case.greedy(0)
    assert list(tmp_path.iterdir()) == [], "the CLI wrote files into the working directory"


def test_missing_checkpoint_gives_download_hint_without_traceback(tmp_path):
    proc = run_cli("hal=cpu", "model=ouro-1.4b", "prompt=hello", cwd=tmp_path)
    assert proc.returncode != 0
    assert "huggingface-cli download ByteDance/Ouro-1.4B" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_hal_lists_known_ones(tmp_path):
    proc = run_cli("hal=foo", cwd=tmp_path)
    assert proc.returncode != 0
    for name in ("auto", "cpu", "cuda", "rocm", "ascend"):
        assert f"\t{name}" in proc.stderr


def test_no_arguments_runs_the_packaged_model_or_explains_models(tmp_path):
    proc = run_cli(cwd=tmp_path)
    if packaged_checkpoint("ouro-tiny") is None:       # an install without the trained checkpoint
        assert proc.returncode == 2
        assert "ouro-1.4b" in proc.stderr and "model.path=" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert len(re.findall(r"[A-Za-z]{2,}", proc.stdout)) >= 5, proc.stdout
    assert "Traceback" not in proc.stderr


def test_bad_override_type_is_rejected(tmp_path):
    proc = run_cli("max_tokens=abc", cwd=tmp_path)
    assert proc.returncode != 0 and "max_tokens" in proc.stderr
