"""`python -m runtime.generate`: the golden continuation, clear errors, nothing written to the cwd."""
import json
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT, golden_case
from zoo.resolve import packaged_checkpoint


def run_cli(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "runtime.generate", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


# model.dtype=auto (vLLM's spelling) is the checkpoint's dtype: float32 for ouro-tiny's golden weights
@pytest.mark.parametrize("name,dtype", [("ouro-tiny", "float32"), ("ouro-tiny", "auto"),
                                        ("ouro-tiny-gqa-bf16", "float32")])
def test_prints_golden_continuation(name, dtype, tmp_path):
    case = golden_case(name)
    ids = case.prompt(0)
    n = case.meta["greedy_new_tokens"]
    proc = run_cli("hal=cpu", f"model.path={case.path}", f"prompt_ids=[{','.join(map(str, ids))}]",
                   f"max_tokens={n}", "temperature=0", f"model.dtype={dtype}", "ignore_eos=true", "output=json",
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
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "hal=foo is not one of the hal options: ascend, ascend-sim, auto, cpu, cuda, rocm" in proc.stderr


def test_no_arguments_runs_the_packaged_model_or_explains_models(tmp_path):
    proc = run_cli(cwd=tmp_path)
    if packaged_checkpoint("ouro-tiny") is None:       # an install without the trained checkpoint
        assert proc.returncode == 2
        assert "ouro-1.4b" in proc.stderr and "model.path=" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert len(re.findall(r"[A-Za-z]{2,}", proc.stdout)) >= 5, proc.stdout
    assert "Traceback" not in proc.stderr


def test_a_prompt_hydra_cannot_read_gets_the_quoted_form_to_type(tmp_path):
    """`prompt=It's "wet" (1+1=2)!` is not a Hydra override; the error gives the argument to type."""
    import shlex

    proc = run_cli("prompt=It's \"wet\" (1+1=2)!", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    suggested = shlex.split(proc.stderr.strip().rsplit(": ", 1)[1])
    proc = run_cli(*suggested, "max_tokens=2", "output=json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["prompt"] == "It's \"wet\" (1+1=2)!"


def test_bad_override_type_is_rejected(tmp_path):
    proc = run_cli("max_tokens=abc", cwd=tmp_path)
    assert proc.returncode != 0 and "max_tokens" in proc.stderr


def compose_generate(*overrides):
    from hydra import compose, initialize_config_dir

    from runtime.generate import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("generate", overrides=list(overrides))


@pytest.mark.parametrize("overrides,expected", [
    (["model=huginn-0125"], dict(temperature=0.7, top_p=1.0, top_k=50, stop_token_ids=())),
    (["model=nanbeige4.2-3b"], dict(temperature=0.6, top_p=0.95, top_k=20, stop_token_ids=())),
    (["model=nanbeige4.2-3b", "temperature=0"], dict(temperature=0.0, top_p=0.95, top_k=20)),
    (["model=nanbeige4.2-3b", "top_p=0.5", "top_k=0"], dict(temperature=0.6, top_p=0.5, top_k=0)),
    (["model=ouro-1.4b"], dict(temperature=0.0, top_p=1.0, top_k=0, stop_token_ids=())),   # the engine's
    (["model.path=/x", "temperature=0.9", "init_scale=0", "seed=3"], dict(temperature=0.9, init_scale=0.0, seed=3)),
])
def test_sampling_defaults_come_from_the_model_unless_the_command_line_sets_them(overrides, expected):
    from runtime.generate import sampling_params

    params = sampling_params(compose_generate(*overrides))
    assert {k: getattr(params, k) for k in expected} == expected


def test_a_checkpoint_folders_generation_config_gives_the_clis_defaults(tmp_path, monkeypatch):
    """`model.path=` names a folder whose node sets no sampling: its generation_config.json does, for
    runtime.generate and runtime.serve alike, min_p and repetition_penalty too (LLM() applied it, the
    CLIs did not); the command line wins."""
    from runtime.generate import sampling_params
    from runtime.serve import server_config

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 5, "top_p": 0.9,
                                                                  "min_p": 0.05, "repetition_penalty": 1.3}))
    params = sampling_params(compose_generate(f"model.path={tmp_path}"))
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
        (0.7, 0.9, 5, 0.05, 1.3)
    params = sampling_params(compose_generate(f"model.path={tmp_path}", "temperature=0", "top_k=0", "min_p=0",
                                              "repetition_penalty=1.0"))
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == \
        (0.0, 0.9, 0, 0.0, 1.0)
    from hydra import compose, initialize_config_dir

    from runtime.cli import CONF_DIR
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("serve", overrides=[f"model.path={tmp_path}"])
    sampling = server_config(cfg).sampling
    hub = tmp_path / "snapshot"                  # a hub id's folder in the local cache
    hub.mkdir()
    (hub / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    monkeypatch.setattr("zoo.resolve._hub_cache_snapshot", lambda repo_id, cache_dir: hub if repo_id == "org/tiny" else None)
    assert sampling_params(compose_generate("model.path=org/tiny")).temperature == 0.3
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p, sampling.repetition_penalty) == \
        (0.7, 0.9, 5, 0.05, 1.3)
    from runtime.sampling_params import SamplingDefaults
    assert SamplingDefaults(min_p=0.1, repetition_penalty=1.3).resolve(min_p=0.0, repetition_penalty=1.0) == \
        {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}   # given wins
