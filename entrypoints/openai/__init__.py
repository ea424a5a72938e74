"""The OpenAI-style HTTP server over AsyncOmni: ``create_app(model)`` (see ``server.py``)."""

from .server import create_app

__all__ = ["create_app"]
