"""The one parser of request bodies: every POST route's JSON goes through :func:`parse_json`
(bounded nesting and number literals, so a hostile body is a 400 naming what is wrong, never a
``RecursionError`` or a 500), and the ``model`` a request names is read from the parsed body,
its form or its query by :func:`requested_model`. Runs on the server's event loop.

Every router is made with ``route_class=BodyRoute``: its routes see a :class:`BodyRequest`,
whose JSON is parsed once (before FastAPI's own body handling, so the errors here keep their
message) and then shared by the route's body model and its dependencies."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response

from omni_runtime.serialization import MAX_DEPTH

from .protocol import ApiError
from .uploads import parse_form

#: Longest number literal a JSON body may hold (a 64-bit integer has 20 digits; a float's
#: shortest repr at most 24 characters): past it, a 400 before any conversion.
MAX_NUMBER_CHARS = 64

_MISSING = object()


def _number(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        if len(text) > MAX_NUMBER_CHARS:
            raise ApiError(
                400, f"a number in the JSON body is {len(text)} characters long; the limit is {MAX_NUMBER_CHARS}",
                code="invalid_json",
            )  # fmt: skip
        return kind(text)

    return parse


_parse_int, _parse_float = _number(int), _number(float)


def _too_deep() -> ApiError:
    return ApiError(400, f"the JSON body nests deeper than {MAX_DEPTH} levels", code="invalid_json")


def _check_depth(value: Any) -> None:
    """Walk the parsed document without recursion; a 400 past MAX_DEPTH levels."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            if isinstance(child, dict | list):
                if depth + 1 > MAX_DEPTH:
                    raise _too_deep()
                stack.append((child, depth + 1))


def parse_json(raw: bytes) -> Any:
    """A JSON body as Python values, or the 400 that refuses it: malformed (the error FastAPI
    gives, ``invalid_json``), nested deeper than MAX_DEPTH, or a number literal longer than
    MAX_NUMBER_CHARS."""
    try:
        value = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        error = {"type": "json_invalid", "loc": ("body", getattr(e, "pos", 0)), "msg": "JSON decode error"}
        raise RequestValidationError([error | {"input": {}, "ctx": {"error": str(e)}}]) from None
    except RecursionError:
        raise _too_deep() from None
    _check_depth(value)
    return value


def _is_json(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _is_form(request: Request) -> bool:
    return request.headers.get("content-type", "").lower().startswith("multipart/form-data")


class BodyRequest(Request):
    """A request whose JSON body is parsed by :func:`parse_json`, once."""

    _parsed: Any = _MISSING

    async def json(self) -> Any:
        if self._parsed is _MISSING:
            self._parsed = parse_json(await self.body())
        return self._parsed


class BodyRoute(APIRoute):
    """A route whose JSON body is parsed by :func:`parse_json` before FastAPI reads it."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def parse_first(request: Request) -> Response:
            request = BodyRequest(request.scope, request.receive)
            if request.method == "POST" and _is_json(request) and await request.body():
                await request.json()
            return await handler(request)

        return parse_first


async def requested_model(request: Request) -> object:
    """The ``model`` a request names: its JSON body's field, its form's field, else its query's
    (None when it names none). The body is parsed here once, and the route reads it again from
    the cache."""
    if request.method == "POST" and _is_json(request):
        data = await request.json() if await request.body() else None
        return data.get("model") if isinstance(data, dict) else None
    if request.method == "POST" and _is_form(request):
        form = await parse_form(request)
        value = form.get("model")
        return value if isinstance(value, str) else None
    return request.query_params.get("model")
