"""ASGI middleware: the API key check and the request body size limit.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would buffer streamed responses and
hide client disconnects from the routes.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection
from http import HTTPStatus

from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.openai.errors import error_response


class ApiKeyMiddleware:
    """Answers 401 unless the request carries `Authorization: Bearer <api_key>`.

    The key is compared in constant time, so response timing does not reveal how much of a guess was
    right. `open_paths` (health checks, metrics scrapes) need no key. The key is never logged: a
    SecretStr keeps it out of reprs.
    """

    def __init__(self, app: ASGIApp, api_key: str | SecretStr, open_paths: Collection[str]) -> None:
        self.app = app
        key = api_key.get_secret_value() if isinstance(api_key, SecretStr) else api_key
        self._expected = f"Bearer {key}".encode()
        self._open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self._open_paths:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, self._expected):
                response = error_response(HTTPStatus.UNAUTHORIZED, "Invalid or missing API key.")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Answers 413 when a request body is over `max_bytes`.

    A Content-Length over the limit is refused before any of the body is read; a body without one
    (chunked) is read up to the limit and refused as soon as it passes it. The body read is handed
    to the app unchanged, and later messages (the client's disconnect) pass through.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # the client left; the app will see it
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"Request body too large: the limit is {self.max_bytes} bytes."
        await error_response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, message)(scope, receive, send)
