"""omni_runtime: a serving runtime for multi-stage generation models.

``from omni_runtime import Omni, AsyncOmni`` works as usual, but the user-facing layer is loaded
on first use only: a stage process imports ``omni_runtime.stage.process`` and must not pay for
(or depend on) janus, the orchestrator or the HTTP server.
"""

from pathlib import Path as _Path
from typing import TYPE_CHECKING, Any

# In a source checkout the user-facing surfaces live in the top-level ``entrypoints/`` folder, which
# an installed wheel carries as ``omni_runtime/entrypoints`` (pyproject maps it). Let the checkout's
# folder answer for ``omni_runtime.entrypoints`` too, so the tree runs without reinstalling.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "entrypoints" / "__init__.py").is_file():
    __path__.append(str(_checkout))

from omni_runtime.exceptions import *  # noqa: E402, F403 - light, and what callers catch

#: Public name -> the module that defines it, imported when the name is first used.
_LAZY = {
    "AsyncOmni": "omni_runtime.entrypoints.async_omni",
    "Omni": "omni_runtime.entrypoints.omni",
    "MultiOmni": "omni_runtime.entrypoints.multi_omni",
    "DeployConfig": "omni_runtime.config",
    "load_config": "omni_runtime.config",
    "OmniRequestOutput": "omni_runtime.outputs",
    "StageResult": "omni_runtime.outputs",
    "DiffusionSamplingParams": "omni_runtime.params",
    "EchoSamplingParams": "omni_runtime.params",
    "TextSamplingParams": "omni_runtime.params",
    "TranscriptionSamplingParams": "omni_runtime.params",
}

__all__ = [
    "AsyncOmni",
    "DeployConfig",
    "DiffusionSamplingParams",
    "EchoSamplingParams",
    "MultiOmni",
    "Omni",
    "OmniRequestOutput",
    "StageResult",
    "TextSamplingParams",
    "TranscriptionSamplingParams",
    "load_config",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'omni_runtime' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:
    from omni_runtime.config import DeployConfig, load_config
    from omni_runtime.entrypoints.async_omni import AsyncOmni
    from omni_runtime.entrypoints.multi_omni import MultiOmni
    from omni_runtime.entrypoints.omni import Omni
    from omni_runtime.outputs import OmniRequestOutput, StageResult
    from omni_runtime.params import (
        DiffusionSamplingParams,
        EchoSamplingParams,
        TextSamplingParams,
        TranscriptionSamplingParams,
    )
