"""The JSON every route answers with, and the one place an error becomes a response: the OpenAI
error shape with its headers (``Retry-After``, ``WWW-Authenticate``)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from omni_runtime.exceptions import QueueFullError, UnavailableError

from .protocol import ApiError, error_body


class SafeJSONResponse(JSONResponse):
    """JSON that always renders: a string UTF-8 cannot encode (a lone surrogate quoted from the
    request, say) goes out as its ``\\udXXX`` JSON escape instead of failing the response."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(
            "utf-8", "backslashreplace"
        )


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    headers = {}
    if isinstance(exc, QueueFullError | UnavailableError):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    elif isinstance(exc, ApiError) and exc.code == "loading":
        headers["Retry-After"] = "1"
    elif status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return SafeJSONResponse(body, status_code=status, headers=headers)


def json_with_id(result: tuple[dict[str, Any], str]) -> JSONResponse:
    """A route's JSON body and its request id (the ``X-Request-Id`` header)."""
    body, request_id = result
    return SafeJSONResponse(body, headers={"X-Request-Id": request_id})
