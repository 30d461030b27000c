"""uvicorn with a shutdown that is graceful for generation requests.

On SIGINT / SIGTERM (or `server.should_exit = True`) uvicorn stops accepting connections and waits
for open ones. A generation request can outlast any sensible wait, so the engine loop is told at the
same moment: it keeps stepping admitted requests for `shutdown_timeout_s`, then aborts the rest,
whose streams end properly (a last chunk with finish_reason "abort", then `[DONE]`) and whose plain
requests get 503. uvicorn's own timeout, a little longer, is only a backstop.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn

from runtime.server.engine_loop import EngineLoop

BACKSTOP_S = 5.0          # after the engine's grace period: time for the last chunks to go out


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.engine_loop, self.shutdown_timeout_s = engine_loop, shutdown_timeout_s
        self._drain: asyncio.Future | None = None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # not awaited here: uvicorn closes its listeners and waits for connections meanwhile
        self._drain = asyncio.ensure_future(asyncio.to_thread(
            self.engine_loop.shutdown, drain_timeout_s=self.shutdown_timeout_s))
        await super().shutdown(sockets)
        await self._drain


def make_server(app: Any, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout_s: float = 30.0,
                log_level: str = "info") -> GracefulServer:
    """A server for an app from `build_app`; run it with `.run()` (or `.run(sockets=[...])`)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout_s + BACKSTOP_S)
    return GracefulServer(config, app.state.engine_loop, shutdown_timeout_s)
