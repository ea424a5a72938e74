"""The encoder registry: the formats media items can be rendered to, by kind and format, each
with its media type and the function that makes the file's bytes.

Below both :mod:`omni_runtime.media` (an item's ``save`` renders through it) and
:mod:`omni_runtime.encoders` (which holds the builtin encoders and registers them as it is
imported). The builtins are imported by name on the first use of the registry, as the family and
backend registries import theirs, so any item renders whatever its caller imported first.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omni_runtime.media import MediaItem

#: The module that registers the builtin formats when it is imported.
BUILTIN_ENCODERS = "omni_runtime.encoders"

Encode = Callable[..., bytes]


@dataclass(frozen=True)
class Encoder:
    """One registered format of one kind."""

    kind: str
    format: str
    media_type: str
    fn: Encode


_REGISTRY: dict[str, dict[str, Encoder]] = {}


def _registry() -> dict[str, dict[str, Encoder]]:
    """The registry, with the builtin formats in it (imported once; a no-op after, and while the
    builtin module itself registers them)."""
    importlib.import_module(BUILTIN_ENCODERS)
    return _REGISTRY


def register_encoder(kind: str, format: str, media_type: str, fn: Encode) -> None:
    """Make ``format`` available for items of ``kind`` (a later registration replaces one of the
    same kind and format)."""
    _registry().setdefault(kind, {})[format] = Encoder(kind, format, media_type, fn)


def unregister_encoder(kind: str, format: str) -> None:
    """Remove a format (tests that register a throwaway one)."""
    registry = _registry()
    formats = registry.get(kind, {})
    formats.pop(format, None)
    if not formats:
        registry.pop(kind, None)


def formats(kind: str) -> tuple[str, ...]:
    """The formats items of ``kind`` can be encoded to, in registration order."""
    return tuple(_registry().get(kind, {}))


def media_type(kind: str, format: str) -> str:
    """The media type (``image/png``) of ``format`` for ``kind``; KeyError if not registered."""
    return encoder(kind, format).media_type


def media_types() -> dict[str, str]:
    """Every registered format's media type by format name (what a file store serves)."""
    return {e.format: e.media_type for kinds in _registry().values() for e in kinds.values()}


def encoder(kind: str, format: str) -> Encoder:
    try:
        return _registry()[kind][format]
    except KeyError:
        raise KeyError(f"no {format!r} encoder for {kind} items; registered: {list(formats(kind))}") from None


def encode(item: MediaItem, format: str, **options: Any) -> bytes:
    """``item`` as the bytes of a ``format`` file."""
    return encoder(item.kind, format).fn(item, **options)
