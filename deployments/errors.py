"""Every error the encode server answers: one table from exception type to HTTP status and
error type, one JSON envelope, and the FastAPI handlers that apply them.

Routes raise; they never build error responses themselves. ``classify`` walks an
exception's class hierarchy, so a subclass inherits its parent's row unless it has one
of its own (``LimitExceededError`` is an ``EncoderInputError`` with its own 413). The
metrics' ``outcome`` label is the error type of this table, or ``ok``/``cancelled``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from kimi_encoder.engines.ecpush import EcPushError
from kimi_encoder.engines.sglang import ReceiveTimeout, RegistryFull, error_body
from kimi_encoder.engines.transport import PushError
from kimi_encoder.items import EncoderInputError, LimitExceededError, UnsupportedFormatError

from .admission import (
    BodyLostError,
    BodyTimeoutError,
    IngressBusyError,
    MalformedBodyError,
    UnsupportedMediaTypeError,
)
from .fanout import NoRankAvailableError, RequestTimeoutError
from .security import UnauthorizedError

log = logging.getLogger("ray.serve")


# Exception type -> (HTTP status, error type). Order does not matter: the most derived
# class of an exception that has a row wins.
ERRORS: dict[type[BaseException], tuple[int, str]] = {
    EncoderInputError: (400, "invalid_request"),
    UnauthorizedError: (401, "unauthorized"),
    BodyTimeoutError: (408, "body_timeout"),
    LimitExceededError: (413, "limit_exceeded"),
    UnsupportedMediaTypeError: (415, "unsupported_media_type"),
    UnsupportedFormatError: (415, "unsupported_media_type"),
    MalformedBodyError: (422, "validation_error"),
    ValidationError: (422, "validation_error"),
    PushError: (502, "bad_gateway"),
    NoRankAvailableError: (503, "unavailable"),
    BodyLostError: (503, "unavailable"),
    EcPushError: (503, "unavailable"),
    IngressBusyError: (503, "unavailable"),
    RegistryFull: (503, "unavailable"),
    RequestTimeoutError: (504, "timeout"),
    ReceiveTimeout: (504, "timeout"),
}
INTERNAL = (500, "internal_error")
# The outcome label of the request metrics: every error type, plus these two.
OUTCOMES = ("ok", *dict.fromkeys(kind for _, kind in [*ERRORS.values(), INTERNAL]), "cancelled")


class PartFailedError(Exception):
    """An sglang ``/encode`` part failed with ``cause``: answered as the cause, with the
    part's ``req_id`` and the ``message`` also at the top of the body, where sglang's
    prefill reads them."""

    def __init__(self, req_id: str | None, cause: BaseException):
        super().__init__(str(cause))
        self.req_id = req_id
        self.cause = cause


def classify(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, error type) of ``exc``; anything without a row is an internal error."""
    if isinstance(exc, PartFailedError):
        exc = exc.cause
    for cls in type(exc).__mro__:
        if cls in ERRORS:
            return ERRORS[cls]
    return INTERNAL


def error_response(
    status: int,
    kind: str,
    message: str,
    headers: Mapping[str, str] | None = None,
    extra: Mapping[str, object] | None = None,
) -> JSONResponse:
    """The one error envelope: ``{"error": {"type", "message"}}`` (plus ``extra`` keys)."""
    body = {**(extra or {}), "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status, headers=dict(headers or {}))


def error_headers(exc: BaseException) -> dict[str, str]:
    if (retry := getattr(exc, "retry_after_s", None)) is not None:
        return {"Retry-After": str(retry)}
    if isinstance(exc, RegistryFull):
        return {"Retry-After": "1"}
    if isinstance(exc, UnauthorizedError):
        return {"WWW-Authenticate": "Bearer"}
    return {}


def message_of(exc: BaseException) -> str:
    """The message a client gets for ``exc``."""
    if isinstance(exc, PartFailedError):
        exc = exc.cause
    if isinstance(exc, ValidationError):
        return validation_message(exc)
    if classify(exc) == INTERNAL:
        return f"{type(exc).__name__}: {exc}"
    return str(exc)


def response_for(exc: BaseException) -> JSONResponse:
    """The JSON error answering ``exc`` (an unexpected one is logged with its traceback)."""
    cause = exc.cause if isinstance(exc, PartFailedError) else exc
    status, kind = classify(cause)
    if (status, kind) == INTERNAL:
        log.error("request failed", exc_info=cause)
    message = message_of(cause)
    extra = error_body(exc.req_id, message) if isinstance(exc, PartFailedError) else None
    return error_response(status, kind, message, error_headers(cause), extra)


def validation_message(exc: ValidationError) -> str:
    """Pydantic's errors as ``field.path: message; ...`` naming the request's own fields."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in _field_path(err.get("loc", ())))
        parts.append(f"{loc or 'body'}: {str(err.get('msg')).rstrip('.')}")
    return "; ".join(parts) + ". See /docs for the request schema."


def _field_path(loc: tuple) -> list:
    """``loc`` without 'body' and the item-kind tag after an item index.

    ``body.items.1.image.image`` -> ``items.1.image`` (the tag comes from ``schemas.Item``).
    """
    path = [p for p in loc if p != "body"]
    return [
        p
        for i, p in enumerate(path)
        if not (i and isinstance(path[i - 1], int) and p in ("image", "other"))
    ]


class _Unexpected:
    """ASGI middleware: an exception no handler took becomes the JSON 500, not Starlette's
    plain-text one (unless the response had already started)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def sending(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started or scope["type"] != "http":
                raise
            await response_for(exc)(scope, receive, send)


def install(app: FastAPI) -> None:
    """Answer every table entry, any other exception (500) and Starlette's own 404/405
    with the envelope."""

    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        return response_for(exc)

    async def on_http(_: Request, exc: HTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, kind, str(exc.detail), exc.headers)

    for exc_type in (*ERRORS, PartFailedError):
        app.add_exception_handler(exc_type, on_error)
    app.add_exception_handler(HTTPException, on_http)
    app.add_middleware(_Unexpected)
