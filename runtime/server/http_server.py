"""uvicorn with a shutdown that is graceful for generation requests.

On SIGINT / SIGTERM (or `server.should_exit = True`) the engine loop stops admitting requests and
keeps stepping the admitted ones for `shutdown_timeout_s`, then aborts the rest: their streams end
properly (a last chunk with an OpenAI finish_reason, an error object, then `[DONE]`) and their plain
requests get 503. Meanwhile the server still accepts connections, so a new request gets 503 with
`Retry-After` rather than "connection refused". Only then does uvicorn stop listening and wait for
open connections; its own timeout, a little longer, is only a backstop. A second Ctrl-C ends the
drain at once (what is still running is aborted), as it ends uvicorn's own wait.
"""
from __future__ import annotations

import asyncio
import socket
from typing import Any

import uvicorn

from runtime.server.engine_loop import EngineLoop

BACKSTOP_S = 5.0          # after the engine's grace period: time for the last chunks to go out
FORCE_POLL_S = 0.1        # how often the drain looks for a second Ctrl-C


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, shutdown_timeout_s: float) -> None:
        super().__init__(config)
        self.engine_loop, self.shutdown_timeout_s = engine_loop, shutdown_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # drain first, still listening: requests arriving now are answered 503 (the loop refuses them)
        drain = asyncio.ensure_future(asyncio.to_thread(
            self.engine_loop.shutdown, drain_timeout_s=self.shutdown_timeout_s))
        while not drain.done():
            if self.force_exit:           # a second Ctrl-C (uvicorn's force_exit): end the drain now
                await asyncio.to_thread(self.engine_loop.shutdown, drain_timeout_s=0.0)
                break
            await asyncio.wait({drain}, timeout=FORCE_POLL_S)
        await drain
        await super().shutdown(sockets)
        if self.force_exit:
            # uvicorn skips the app's lifespan shutdown on a forced exit, and asyncio then cancels the
            # lifespan task, which starlette logs as a CancelledError traceback; the engine has stopped
            # by now, so that shutdown returns at once: run it
            await self.lifespan.shutdown()


def make_server(app: Any, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout_s: float = 30.0,
                log_level: str = "info", loop: str = "asyncio") -> GracefulServer:
    """A server for an app from `build_app`; run it with `.run()` (or `.run(sockets=[...])`).
    `loop`: asyncio's by default, not uvloop (uvicorn's choice where it is installed, e.g. by
    uvicorn[standard]): the engine thread shares the GIL with this loop, and under uvloop its decode
    step took about twice the host time at 64 streams (`tools/serve_host_cost.py --loop uvloop`)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, loop=loop,
                            timeout_graceful_shutdown=shutdown_timeout_s + BACKSTOP_S)
    return GracefulServer(config, app.state.engine_loop, shutdown_timeout_s)
