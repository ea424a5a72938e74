"""One table per route between its request fields and the engine params they become, read both
ways: :meth:`FieldMap.params` builds the engine params from a request body, and
:meth:`FieldMap.rename` turns the param an engine error names back into the request field that
carries it (``height`` -> ``size``, ``timeout`` -> ``config.timeout``), so a 400 names what the
client sent. The tables themselves are the task registry's, one per task and surface
(entrypoints/tasks/fields.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.exceptions import InvalidRequestError

#: An engine param, or several filled from one field (``size`` -> ``width``, ``height``).
Params = str | tuple[str, ...]


def _attribute(path: str) -> Callable[[Any], Any]:
    def read(body: Any) -> Any:
        for name in path.split("."):
            body = getattr(body, name)
        return body

    return read


@dataclass(frozen=True)
class FieldMap:
    """``fields``: request field (a dotted path into the body) -> engine param(s), built by
    :meth:`params`; ``read``: how a field's value is read when it is not the attribute as it is
    (a LoRA spec's params, ``size`` as its dimensions); ``computed``: fields the route turns into
    params itself (an upload, a per-image seed), mapped back in errors only."""

    fields: Mapping[str, Params]
    read: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    computed: Mapping[str, Params] = field(default_factory=dict)

    def _value(self, name: str, body: Any) -> Any:
        return self.read.get(name, _attribute(name))(body)

    def names(self) -> tuple[str, ...]:
        """Every request field it maps, the computed ones last."""
        return (*self.fields, *self.computed)

    def given(self, body: Any) -> list[str]:
        """The fields of :meth:`names` that ``body`` sets (not None)."""
        return [name for name in self.names() if self._value(name, body) is not None]

    def params(self, body: Any) -> dict[str, Any]:
        """The engine params of ``body`` (unset fields left out)."""
        out: dict[str, Any] = {}
        for name, params in self.fields.items():
            value = self._value(name, body)
            if value is None:
                continue
            if isinstance(params, tuple):
                out.update(zip(params, value, strict=True))
            else:
                out[params] = value
        return out

    def field(self, param: str | None) -> str | None:
        """The request field that carries engine param ``param`` (``param`` when none does)."""
        for name, params in (*self.fields.items(), *self.computed.items()):
            if param == params or (isinstance(params, tuple) and param in params):
                return name
        return param

    def rename(self, error: InvalidRequestError) -> InvalidRequestError:
        """``error`` naming the request field instead of the engine param."""
        error.param = self.field(error.param)
        return error

    def __or__(self, other: FieldMap) -> FieldMap:
        return FieldMap(
            {**self.fields, **other.fields}, {**self.read, **other.read}, {**self.computed, **other.computed}
        )
