"""The API key: `/v1/*` requests need `Authorization: Bearer <key>` when the server has one (vLLM's
`--api-key`); `/health`, `/metrics` and the tokenizer routes stay open, as in vLLM.

A plain ASGI middleware rather than Starlette's `BaseHTTPMiddleware`, which wraps the body stream:
the generation routes watch the client's disconnect to abort its requests.
"""
from __future__ import annotations

import hmac
from typing import Any, Callable

from starlette.responses import JSONResponse

from runtime.server.protocol import error_body


class RequireKey:
    def __init__(self, app: Any, api_key: str, on_refused: Callable[[], None] = lambda: None) -> None:
        self.app, self.expected, self.on_refused = app, f"Bearer {api_key}".encode(), on_refused

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or not _is_openai_route(scope):
            return await self.app(scope, receive, send)
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):         # constant time: no timing oracle on the key
            return await self.app(scope, receive, send)
        self.on_refused()
        body = error_body("missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                          "invalid_request_error", code="invalid_api_key")
        await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


def _is_openai_route(scope: dict[str, Any]) -> bool:
    """Whether the request routes to `/v1` or below, as the router sees it: uvicorn's `--root-path`
    and a parent app's mount put a prefix in front of `path` that routing strips again."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    return path == "/v1" or path.startswith("/v1/")
