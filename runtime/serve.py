"""`python -m runtime.serve hal=cpu model=ouro-1.4b host=127.0.0.1 port=8000`: the OpenAI-compatible
HTTP server (Hydra config `conf/serve.yaml`; FastAPI + uvicorn from the `serve` extra).

Engine options go under `engine.` (engine.kv_mode=shared engine.max_num_seqs=64: the node runtime.generate
and runtime.bench share), server limits under `server.` (server.max_num_requests=256 server.model_name=ouro).
Without `model=` it serves the packaged ouro-tiny, as runtime.generate does. Requests that leave out
temperature / top_p / top_k get the model's generation_config (conf/model/*.yaml), as the CLI does.
SIGINT / SIGTERM stop it gracefully: new requests get 503, in-flight requests get
`server.shutdown_timeout_s` to finish, the rest are aborted.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from runtime.cli import (CONF_DIR, UsageError, check_port, checkpoint_sampling, clear_errors, engine_config,
                         known_models, make_hal, model_source, register_schemas, setup_logging)
from runtime.cli_args import check_argv
from runtime.config import ServeConfig
from runtime.sampling_params import SamplingDefaults

API_KEY_ENV = "LOOPSTACK_API_KEY"       # the key without putting it on the command line (ps shows argv)

log = logging.getLogger("runtime.serve")


def no_model_message() -> str:
    return "\n".join([
        "No model selected: pass model=NAME (a checkpoint in the local Hugging Face cache) or "
        "model.path=/path/to/checkpoint.",
        f"Known models: {', '.join(known_models())}",
        "Example: python -m runtime.serve hal=cpu model=ouro-1.4b host=127.0.0.1 port=8000"])


def server_config(cfg: Any) -> Any:
    """The `server:` node plus what the `model:` node says about requests."""
    from runtime.server.config import ServerConfig

    fields = OmegaConf.to_container(cfg.server) if OmegaConf.is_config(cfg.server) else dict(cfg.server)
    source = model_source(cfg)
    fields["model_name"] = fields.get("model_name") or cfg.model.name or Path(str(source)).name
    fields["api_key"] = fields.get("api_key") or os.environ.get(API_KEY_ENV) or None
    try:
        return ServerConfig(**fields, default_num_loops=cfg.model.num_loops,
                            default_exit_threshold=cfg.model.exit_threshold,
                            sampling=SamplingDefaults.from_model(cfg.model, checkpoint_sampling(cfg)))
    except ValueError as exc:
        raise UsageError(f"error: server.{exc}") from None


def make_app(cfg: Any, hal: Any = None, parallel: Any = None) -> Any:
    """The app the command line would serve, without Hydra or a socket (tests call this). Under
    tensor parallelism (`parallel`, rank 0) the engine sends its steps to the other ranks."""
    source = model_source(cfg)
    if not source:
        raise UsageError(no_model_message())
    try:
        from runtime.server.app import build_app
    except ImportError as exc:
        raise UsageError(f"serving needs the serve extra ({exc.name} is missing): "
                         f"pip install 'loopstack[serve]'") from None
    from runtime.llm import LLM

    engine = engine_config(cfg)
    config = server_config(cfg)
    llm = LLM(source, hal=hal or make_hal(cfg.hal), dtype=cfg.model.dtype, engine_config=engine,
              parallel=parallel, stop_token_ids=tuple(cfg.model.stop_token_ids))
    return build_app(llm.engine, config)


register_schemas()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="serve")
def _main(cfg: DictConfig) -> None:
    setup_logging(cfg.log_level)
    with clear_errors(cfg.log_level):
        started = _start(cfg)
    if started is None:                         # a follower rank of a tensor-parallel run: done
        return
    app, sock = started
    parallel = app.state.parallel
    from runtime.server.http_server import make_server

    host, port = sock.getsockname()[:2]
    log.info("serving %s on http://%s:%d/v1", app.state.model_name, host, port)
    try:
        # uvicorn's level names: log_level=warn is "warning", fatal "critical"
        level = logging.getLevelName(logging.getLevelName(str(cfg.log_level).upper())).lower()
        make_server(app, cfg.host, port, cfg.server.shutdown_timeout_s, level).run(sockets=[sock])
    finally:
        parallel.shutdown()                     # the engine thread has stopped: release the other ranks


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use or an unknown host fails at
    once, naming the option, not after the weights are read."""
    try:       # the family by the host's spelling, as uvicorn binds: "localhost" and "" stay IPv4
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)           # connections from now on wait in the backlog until uvicorn accepts
    except OSError as exc:
        raise UsageError(f"error: cannot listen on host={host} port={port}: {exc.strerror or exc}; choose another "
                         f"port= (0: any free one) or host=") from None
    return sock


def _start(cfg: Any) -> Any:
    """The app and its bound socket on rank 0 (or without tensor parallelism); None on the other
    ranks, after they have followed rank 0's engine until it stopped."""
    from runtime.llm import follow
    from runtime.parallel.state import init_from_cli

    source = model_source(cfg)
    if not source:
        raise UsageError(no_model_message())
    check_port(cfg.port)
    engine_config(cfg)                  # bad options fail before a model is built
    server_config(cfg)                           # bad server options fail before a model loads
    hal = make_hal(cfg.hal)
    parallel = init_from_cli(hal, cfg)           # parallel.tp=N under torchrun
    try:
        if not parallel.is_driver:
            follow(source, hal, cfg.model.dtype, parallel)
            parallel.shutdown()
            return None
        sock = listen(cfg.host, cfg.port)
        try:
            app = make_app(cfg, hal, parallel)
        except BaseException:
            sock.close()
            raise
    except BaseException:
        parallel.shutdown()
        raise
    app.state.parallel = parallel
    return app, sock


def main() -> None:
    check_argv(sys.argv[1:], ServeConfig, "runtime.serve", "serve", serves=True)
    _main()


if __name__ == "__main__":
    main()
