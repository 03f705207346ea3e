"""Errors in OpenAI's JSON shape, and the exception handlers that produce them.

Every failure a client can see is `{"error": {"message", "type", "param", "code"}}` with the
matching status: 400 for bad requests (malformed JSON, invalid fields, prompts over the context),
401 for a missing or wrong API key, 404 for an unknown model or route, 409 for a prefix-cache reset
while requests run, 413 for oversized bodies, 503 with a `Retry-After` header when the engine is
dead, full (max_waiting_requests) or the server is draining, 504 when a request's deadline passed
(`timeout`), 500 for anything unexpected (whose traceback the server logs with the
request id: see catch_all.py, which keeps any exception from reaching the server).
"""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from cluster.openai.input_checks import INVALID_UNICODE
from cluster.openai.protocol import ErrorInfo, ErrorResponse
from engine.exceptions import EngineDeadError, EngineOverloadedError

# The class names of the official openai client's exceptions for these statuses (as vLLM uses).
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.CONFLICT: "ConflictError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.GATEWAY_TIMEOUT: "TimeoutError",
}
# Seconds a client should wait before retrying a 503 (the engine full, draining, or being replaced).
RETRY_AFTER_S = 1
# The engine's validation messages start with the field they are about ("temperature must be ...").
_LEADING_NAME = re.compile(r"[a-z_]+")


class OpenAIError(Exception):
    """An error to report to the client with this status, message and (optionally) the bad field."""

    def __init__(self, status: HTTPStatus, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: HTTPStatus, message: str, param: str | None = None) -> ErrorResponse:
    error_type = _ERROR_TYPES.get(status, status.phrase.replace(" ", "") + "Error")
    # A message may quote the request (a model name); what UTF-8 cannot hold is escaped, so that
    # the error itself can always be sent.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=status.value))


def error_response(status: HTTPStatus, message: str, param: str | None = None) -> JSONResponse:
    return body_response(error_body(status, message, param))


def body_response(body: ErrorResponse) -> JSONResponse:
    """The error as a response; a 503 says when to retry."""
    unavailable = body.error.code == HTTPStatus.SERVICE_UNAVAILABLE
    headers = {"Retry-After": str(RETRY_AFTER_S)} if unavailable else None
    return JSONResponse(body.model_dump(), status_code=body.error.code, headers=headers)


def describe_exception(exc: BaseException, known_params: frozenset[str] = frozenset()) -> ErrorResponse:
    """The error body for an exception raised while serving a request (also used mid-stream)."""
    if isinstance(exc, OpenAIError):
        return error_body(exc.status, exc.message, exc.param)
    if isinstance(exc, EngineOverloadedError):
        return error_body(HTTPStatus.SERVICE_UNAVAILABLE, str(exc))
    if isinstance(exc, EngineDeadError):
        return error_body(HTTPStatus.SERVICE_UNAVAILABLE, f"The engine is not running: {exc}")
    if isinstance(exc, ValueError):
        return error_body(HTTPStatus.BAD_REQUEST, str(exc), _leading_param(str(exc), known_params))
    return error_body(HTTPStatus.INTERNAL_SERVER_ERROR, f"Internal server error: {type(exc).__name__}")


def _leading_param(message: str, known_params: frozenset[str]) -> str | None:
    match = _LEADING_NAME.match(message)
    return match.group() if match and match.group() in known_params else None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first problem pydantic found, and the top-level field it is in."""
    error = exc.errors()[0]
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    if error.get("type") == INVALID_UNICODE:
        return str(error["msg"]), error["ctx"]["param"]
    if error.get("type") == "json_invalid":
        return f"Invalid JSON in the request body: {error.get('ctx', {}).get('error', error['msg'])}", None
    message = str(error["msg"]).removeprefix("Value error, ")
    if loc:
        return f"{'.'.join(loc)}: {message}", loc[0]
    if error.get("type") == "value_error":  # a check across fields, whose message names them
        return message, None
    if tuple(error.get("loc", ())) == ("body",):  # no body, or not an object
        return f"The request body must be a JSON object: {message}", None
    return message, None


def install_error_handlers(app: FastAPI, known_params: frozenset[str]) -> None:
    """Route every exception to an OpenAI-shaped response; `known_params` are the request fields
    that a ValueError's message may name."""

    async def on_exception(request: Request, exc: Exception) -> JSONResponse:
        return body_response(describe_exception(exc, known_params))

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(HTTPStatus.BAD_REQUEST, message, param)

    async def on_http_exception(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(HTTPStatus(exc.status_code), str(exc.detail))

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_exception)
    # Not `Exception`: Starlette re-raises after answering it, which drops the connection;
    # CatchAllMiddleware answers the unexpected ones instead.
    for exc_type in (OpenAIError, EngineDeadError, EngineOverloadedError, ValueError):
        app.add_exception_handler(exc_type, on_exception)
