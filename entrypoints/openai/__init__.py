"""The OpenAI-style HTTP server over AsyncOmni: ``create_app(model)`` (see ``server.py``).

``create_app`` is imported on first use, so that a module of this package (the protocol's size
parser, which ``omni-runtime generate`` uses) can be imported without FastAPI and the server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .server import create_app

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from .server import create_app  # lazy: imports FastAPI and the engine (see above)

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
