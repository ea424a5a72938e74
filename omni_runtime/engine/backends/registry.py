"""The backend registry (``runtime.backend`` name → backend class), as the engine's backends
package gives it: the registry itself is :mod:`omni_runtime.backend_registry`, below the config
that reads it."""

from __future__ import annotations

from omni_runtime.backend_registry import BACKENDS, backend_class, backend_options, register_backend

__all__ = ["BACKENDS", "backend_class", "backend_options", "register_backend"]
