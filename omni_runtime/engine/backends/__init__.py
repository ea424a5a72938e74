"""Stage backends: where replicas run (see :mod:`.base`)."""

from __future__ import annotations

from omni_runtime.config import DeployConfig

from .base import EngineResources, StageBackend, StageClient


def make_backends(config: DeployConfig, resources: EngineResources) -> dict[str, StageBackend]:
    """One backend for each ``runtime.backend`` the config's stages use."""
    kinds = {s.runtime.backend for s in config.stage_args}
    backends: dict[str, StageBackend] = {}
    if "process" in kinds:
        from .process import ProcessBackend

        backends["process"] = ProcessBackend(config, resources)
    if "inproc" in kinds:
        from .inproc import InProcBackend

        backends["inproc"] = InProcBackend(config, resources)
    if "ray" in kinds:
        from .ray_backend import RayBackend

        backends["ray"] = RayBackend(config, resources)
    return backends


__all__ = ["EngineResources", "StageBackend", "StageClient", "make_backends"]
