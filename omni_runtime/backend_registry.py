"""The backend registry: a ``runtime.backend`` name → its
:class:`~omni_runtime.engine.backends.base.StageBackend` class.

Entries are ``module:Class`` strings, imported when first used, so that loading a config does not
import what another backend needs (Ray, ZMQ). A backend class names its own settings struct
(:attr:`~omni_runtime.engine.backends.base.StageBackend.options`): the ``runtime:`` keys only it
reads, decoded by :func:`omni_runtime.config.parse_config` into ``runtime.options``.

Below :mod:`omni_runtime.config` (which checks a stage's backend and decodes its options) and the
engine's backends package (which imports the config); :mod:`omni_runtime.engine.backends.registry`
gives the same names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import msgspec

    from omni_runtime.engine.backends.base import StageBackend

#: name → ``module:Class`` of the backend.
BACKENDS: dict[str, str] = {
    "process": "omni_runtime.engine.backends.process:ProcessBackend",
    "inproc": "omni_runtime.engine.backends.inproc:InProcBackend",
    "ray": "omni_runtime.engine.backends.ray_backend:RayBackend",
}


def register_backend(name: str, target: str) -> None:
    """Make ``runtime.backend: <name>`` run stages on the backend class ``target`` (``module:Class``)."""
    BACKENDS[name] = target


def backend_class(name: str) -> type[StageBackend]:
    """The backend class registered as ``name``; KeyError if none is."""
    module, _, cls = BACKENDS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def backend_options(name: str) -> type[msgspec.Struct]:
    """The settings struct of the backend registered as ``name``."""
    return backend_class(name).options
