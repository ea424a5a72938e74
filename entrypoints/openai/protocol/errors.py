"""The error ladder, :func:`classify_error`: the one place where every exception (pydantic
validation, the engine's typed errors, the server's own) becomes a status code and the OpenAI
error shape ``{"error": {"message", "type", "param", "code"}}`` (:func:`error_body`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from omni_runtime.exceptions import (
    EngineError,
    InvalidRequestError,
    OmniError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
    StageAsleepError,
    StageDeadError,
    UnavailableError,
)

from .common import UnencodableValue

logger = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ApiError(Exception):
    """An error the HTTP layer itself raises (auth, unknown model, shutting down...)."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code


class ClientDisconnected(Exception):
    """The client closed the connection; its engine requests were aborted."""


#: Set in a request's ASGI scope once its client is known to be gone (the access log says so).
DISCONNECTED = "omni.client_disconnected"


def _validation_param(loc: Sequence[Any]) -> str | None:
    parts = [p for p in loc if p != "body"]
    if not parts or not isinstance(parts[0], str):
        return None  # the body as a whole (missing, or not JSON)
    text = parts[0]
    for p in parts[1:]:
        text += f"[{p}]" if isinstance(p, int) else f".{p}"
    return text


def classify_error(exc: BaseException) -> tuple[int, str, str | None, str | None, str]:
    """(status, type, param, code, message) for any exception: the one place errors are mapped."""
    if isinstance(exc, ApiError):
        return exc.status, exc.type, exc.param, exc.code, str(exc)
    if isinstance(exc, RequestValidationError):
        errors = list(exc.errors())
        first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
        param = _validation_param(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return 400, "invalid_request_error", None, "invalid_json", f"malformed JSON body: {first.get('msg')}"
        if param is None and first.get("type") == "missing":
            return 400, "invalid_request_error", None, "invalid_request", "a JSON request body is required"
        cause = (first.get("ctx") or {}).get("error")
        if isinstance(cause, UnencodableValue):
            return 400, "invalid_request_error", cause.path, "invalid_value", f"invalid value: {cause}"
        if first.get("type") == "extra_forbidden":
            message = f"unknown field `{param}`"
        else:
            message = f"invalid value for `{param}`: {first.get('msg')}" if param else str(first.get("msg"))
        return 400, "invalid_request_error", param, "invalid_value", message
    if isinstance(exc, HTTPException):
        code = "not_found" if exc.status_code == 404 else "http_error"
        return exc.status_code, "invalid_request_error", None, code, str(exc.detail)
    if isinstance(exc, ClientDisconnected):
        return 499, "client_disconnected", None, "client_disconnected", "the client closed the connection"
    if isinstance(exc, QueueFullError):
        return 429, "rate_limit_error", None, "queue_full", str(exc)
    if isinstance(exc, InvalidRequestError):
        return 400, "invalid_request_error", exc.param, "invalid_value", str(exc)
    if isinstance(exc, RequestTimeoutError):
        return 504, "timeout_error", None, "request_timeout", str(exc)
    if isinstance(exc, UnavailableError):
        return 503, "service_unavailable", None, _snake(type(exc).__name__), str(exc)
    if isinstance(exc, StageDeadError | StageAsleepError | RequestAbortedError | EngineError):
        return 503, "service_unavailable", None, _snake(type(exc).__name__), str(exc)
    if isinstance(exc, OmniError):
        return 500, "server_error", None, _snake(type(exc).__name__), str(exc)
    logger.error("unexpected error", exc_info=exc)
    return 500, "server_error", None, "internal_error", f"internal error: {type(exc).__name__}: {exc}"


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_").removesuffix("_error")


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    status, type_, param, code, message = classify_error(exc)
    detail = ErrorDetail(message=message, type=type_, param=param, code=code)
    return status, ErrorResponse(error=detail).model_dump()
