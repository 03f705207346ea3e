"""The outermost ASGI layer: a request id for every request, and no exception ever reaching the server.

Starlette's own handler for `Exception` answers 500 and then re-raises, so the exception reaches
uvicorn, which drops the keep-alive connection and fails the client's next request on it. This
middleware catches everything instead: a 500 in OpenAI's error shape when the response has not
started, else the response is ended cleanly; either way the traceback is logged with the request id.
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid
from http import HTTPStatus

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.openai.errors import error_response

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
# An incoming id is echoed and logged only when it is short, printable ASCII (no log injection).
_SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]{1,128}")

_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("raypage_request_id", default=None)


def current_request_id() -> str | None:
    """The id of the HTTP request being served in this task (None outside one)."""
    return _request_id.get()


def request_id_of(scope: Scope) -> str:
    """The client's `X-Request-Id` when it is safe to echo and log, else a fresh random one (as vLLM)."""
    given = Headers(scope=scope).get(REQUEST_ID_HEADER)
    if given is not None and _SAFE_REQUEST_ID.fullmatch(given):
        return given
    return uuid.uuid4().hex


class CatchAllMiddleware:
    """Tags every HTTP request with a request id (echoed as `X-Request-Id`) and turns any exception
    that escapes the app into a 500 error object, keeping the connection."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id
        token = _request_id.set(request_id)
        started = finished = False

        async def send_tagged(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, receive, send_tagged)
        except Exception as exc:
            logger.exception("request %s %s %s failed", request_id, scope.get("method"), scope.get("path"))
            await self._answer(exc, started, finished, scope, receive, send_tagged)
        finally:
            _request_id.reset(token)

    @staticmethod
    async def _answer(
        exc: Exception, started: bool, finished: bool, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """A 500 if nothing was sent yet; else the body ended where it was, so that the connection
        stays usable. Failing to send (the client left) is not an error worth more than the log."""
        try:
            if not started:
                message = f"Internal server error: {type(exc).__name__}"
                await error_response(HTTPStatus.INTERNAL_SERVER_ERROR, message)(scope, receive, send)
            elif not finished:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:  # the client is gone; nothing is left to tell it
            logger.debug("could not send the error response of a failed request", exc_info=True)
