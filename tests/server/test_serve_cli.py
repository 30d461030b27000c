"""`python -m runtime.serve`: the Hydra config reaches the engine and the server, the command line
serves and stops on SIGTERM, and a missing model is explained."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

SERVE_EXTRA = "needs the serve extra: pip install -e '.[serve]'"
httpx = pytest.importorskip("httpx", reason=SERVE_EXTRA)
pytest.importorskip("fastapi", reason=SERVE_EXTRA)
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from helpers import ROOT
from runtime.cli import CONF_DIR, UsageError
from runtime.serve import make_app


def composed(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("serve", overrides=list(overrides))


def test_config_reaches_the_engine_and_the_server(checkpoint):
    cfg = composed("hal=cpu", f"model.path={checkpoint}", "model.dtype=float32", "model.num_loops=2",
                   "model.stop_token_ids=[5]", "engine.kv_mode=shared", "engine.num_kv_blocks=64",
                   "engine.max_num_seqs=3", "server.max_num_requests=7", "server.retry_after_s=4",
                   "port=9001")
    assert (cfg.host, cfg.port) == ("127.0.0.1", 9001)
    app = make_app(cfg)
    loop = app.state.engine_loop
    engine = loop.engine
    assert (engine.config.kv_mode, engine.blocks.num_blocks, engine.config.max_num_seqs) == ("shared", 64, 3)
    assert loop.max_num_requests == 7 and app.state.model_name == checkpoint.name
    assert engine.tokenizer is not None and next(engine.model.parameters()).dtype.is_floating_point


def test_bad_options_are_refused(checkpoint):
    with pytest.raises(ConfigCompositionException, match="max_num_seqs"):
        composed("engine.max_num_seqs=abc")
    with pytest.raises(ConfigCompositionException, match="max_num_request"):
        composed("server.max_num_request=3")                      # a typo
    with pytest.raises(UsageError, match="engine.kv_mode must be one of"):
        make_app(composed("hal=cpu", f"model.path={checkpoint}", "engine.kv_mode=bogus"))
    with pytest.raises(UsageError, match="model.num_loops=1000 is outside 1..64"):
        make_app(composed("hal=cpu", f"model.path={checkpoint}", "model.num_loops=1000"))


def run_cli(*args, cwd, **options):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "runtime.serve", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **options)


def test_no_model_serves_the_packaged_one_or_explains_how_to_pick_one(tmp_path, monkeypatch):
    import zoo.resolve

    if zoo.resolve.packaged_checkpoint("ouro-tiny") is not None:
        app = make_app(composed("hal=cpu", "engine.num_kv_blocks=64"))
        assert app.state.model_name == "ouro-tiny"
    monkeypatch.setattr(zoo.resolve, "PACKAGED_DIR", tmp_path)       # an install without it
    with pytest.raises(UsageError, match="model.path="):
        make_app(composed("hal=cpu"))


def test_the_command_line_serves_and_stops_on_sigterm(checkpoint, tmp_path):
    proc = run_cli("hal=cpu", f"model.path={checkpoint}", "model.dtype=float32", "port=0",
                   "engine.num_kv_blocks=64", "server.model_name=tiny", "server.shutdown_timeout_s=5",
                   "log_level=INFO", cwd=tmp_path)
    try:
        port = None
        for line in proc.stderr:                   # the port it bound (before the model loaded)
            match = re.search(r"serving tiny on http://127\.0\.0\.1:(\d+)/v1", line)
            if match:
                port = int(match.group(1))
                break
        assert port, "the server did not start"
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": "the cat", "max_tokens": 3, "temperature": 0})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    # uvicorn re-raises the signal once it has shut down, so the exit status says "terminated"
    assert proc.returncode in (0, -signal.SIGTERM), rest
    assert "Application shutdown complete" in rest and "Traceback" not in rest
    assert list(tmp_path.iterdir()) == [], "the server wrote files into the working directory"


def test_a_port_in_use_is_named_before_the_model_loads(checkpoint, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_cli("hal=cpu", f"model.path={checkpoint}", f"port={port}", cwd=tmp_path)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err
    assert f"cannot listen on host=127.0.0.1 port={port}" in err and "choose another port=" in err
    assert "KV cache" not in err                     # refused before the engine was built
