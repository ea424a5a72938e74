"""Stage backends: where replicas run (see :mod:`.base`)."""

from __future__ import annotations

from omni_runtime.config import DeployConfig

from .base import EngineResources, StageBackend, StageClient
from .registry import BACKENDS, backend_class, register_backend


def make_backends(config: DeployConfig, resources: EngineResources) -> dict[str, StageBackend]:
    """One backend for each ``runtime.backend`` the config's stages use (see :mod:`.registry`)."""
    kinds = dict.fromkeys(s.runtime.backend_name for s in config.stage_args)
    return {kind: backend_class(kind)(config, resources) for kind in kinds}


__all__ = [
    "BACKENDS",
    "EngineResources",
    "StageBackend",
    "StageClient",
    "backend_class",
    "make_backends",
    "register_backend",
]
