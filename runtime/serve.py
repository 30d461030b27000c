"""`python -m runtime.serve hal=cpu model=ouro-1.4b host=127.0.0.1 port=8000`: the OpenAI-compatible
HTTP server (Hydra config `conf/serve.yaml`; FastAPI + uvicorn from the `serve` extra).

Engine options go under `engine.` (engine.kv_mode=shared engine.max_num_seqs=64), server limits under
`server.` (server.max_num_requests=256 server.model_name=ouro). SIGINT / SIGTERM stop it gracefully:
no new connections, in-flight requests get `server.shutdown_timeout_s` to finish, the rest are aborted.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from runtime.cli import CONF_DIR, UsageError, clear_errors, known_models, make_hal, register_schemas
from runtime.config import EngineConfig

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
    source = cfg.model.path or cfg.model.name
    fields["model_name"] = fields.get("model_name") or cfg.model.name or Path(str(source)).name
    return ServerConfig(**fields, stop_token_ids=tuple(cfg.model.stop_token_ids),
                        default_num_loops=cfg.model.num_loops,
                        default_exit_threshold=cfg.model.exit_threshold)


def make_app(cfg: Any, hal: Any = None, parallel: Any = None) -> Any:
    """The app the command line would serve, without Hydra or a socket (tests call this). Under
    tensor parallelism (`parallel`, rank 0) the engine sends its steps to the other ranks."""
    if not (cfg.model.path or cfg.model.name):
        raise UsageError(no_model_message())
    try:
        from runtime.server.app import build_app
    except ImportError as exc:
        raise UsageError(f"serving needs the serve extra ({exc.name} is missing): "
                         f"pip install 'loopstack[serve]'") from None
    from runtime.llm import LLM

    engine_config = EngineConfig(**OmegaConf.to_container(cfg.engine))
    config = server_config(cfg)
    llm = LLM(cfg.model.path or cfg.model.name, hal=hal or make_hal(cfg.hal), dtype=cfg.model.dtype,
              engine_config=engine_config, parallel=parallel)
    return build_app(llm.engine, config)


register_schemas()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="serve")
def _main(cfg: DictConfig) -> None:
    logging.basicConfig(level=cfg.log_level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    with clear_errors(cfg.log_level):
        app = _start(cfg)
    if app is None:                             # a follower rank of a tensor-parallel run: done
        return
    parallel = app.state.parallel
    from runtime.server.http_server import make_server

    log.info("serving %s on http://%s:%d/v1", app.state.model_name, cfg.host, cfg.port)
    try:
        make_server(app, cfg.host, cfg.port, cfg.server.shutdown_timeout_s, str(cfg.log_level).lower()).run()
    finally:
        parallel.shutdown()                     # the engine thread has stopped: release the other ranks


def _start(cfg: Any) -> Any:
    """The app on rank 0 (or without tensor parallelism); None on the other ranks, after they have
    followed rank 0's engine until it stopped."""
    from runtime.llm import follow
    from runtime.parallel.state import init_from_cli

    if not (cfg.model.path or cfg.model.name):
        raise UsageError(no_model_message())
    hal = make_hal(cfg.hal)
    parallel = init_from_cli(hal, cfg)           # parallel.tp=N under torchrun
    try:
        if not parallel.is_driver:
            follow(cfg.model.path or cfg.model.name, hal, cfg.model.dtype, parallel)
            parallel.shutdown()
            return None
        app = make_app(cfg, hal, parallel)
    except BaseException:
        parallel.shutdown()
        raise
    app.state.parallel = parallel
    return app


def main() -> None:
    _main()


if __name__ == "__main__":
    main()
