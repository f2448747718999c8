"""The API-key check in front of every route of a vLLM server Eyrie starts with a key.

vLLM 0.32's own check (`vllm/entrypoints/serve/middleware/authenticate.py`) guards only paths under `/v1`, `/v2`,
`/inference` and `/cohere`: `POST /invocations` (SageMaker's alias of the completion, chat and embedding endpoints),
`/ping`, `/health`, `/metrics`, `/tokenize`, `/detokenize`, `/version`, `/load`, `/server_info` and the rest answer
anyone who can reach the port. So when a server has a key (`extraction.api_key_env`), Eyrie starts it with this
middleware too (`--middleware eyrie.vllm.plugin.auth.RequireApiKey`): every HTTP request and WebSocket, on every path
and with every method, must carry `Authorization: Bearer <key>`, or is answered 401 (a WebSocket: closed, 403)
before vLLM sees it. Eyrie's clients and health probes send the key. The key reaches the server as $VLLM_API_KEY, as
vLLM's own check reads it (never on the command line).

Only the standard library and Starlette (vLLM's web framework) here: vLLM imports the class by name when it builds
its app.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Any

KEY_ENV = "VLLM_API_KEY"
MIDDLEWARE = f"{__name__}.RequireApiKey"


class RequireApiKey:
    """ASGI middleware: the bearer key on every request, or 401."""

    def __init__(self, app: Any) -> None:
        key = os.environ.get(KEY_ENV)
        if not key:
            raise RuntimeError(f"{MIDDLEWARE} needs the server's API key in ${KEY_ENV}")
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def _authorized(self, scope: dict) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    return hmac.compare_digest(hashlib.sha256(token.strip().encode()).digest(), self._digest)
        return False

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or self._authorized(scope):
            await self.app(scope, receive, send)  # lifespan events; requests with the key
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # before accept: the client gets HTTP 403
            return
        body = json.dumps({"error": "Unauthorized: this server requires its API key on every route"}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
