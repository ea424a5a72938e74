"""omni_runtime: a serving runtime for multi-stage generation models."""

from pathlib import Path as _Path

# In a source checkout the user-facing surfaces live in the top-level ``entrypoints/`` folder, which
# an installed wheel carries as ``omni_runtime/entrypoints`` (pyproject maps it). Let the checkout's
# folder answer for ``omni_runtime.entrypoints`` too, so the tree runs without reinstalling.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "entrypoints" / "__init__.py").is_file():
    __path__.append(str(_checkout))  # type: ignore[name-defined]

from omni_runtime.config import DeployConfig, load_config  # noqa: E402
from omni_runtime.entrypoints.async_omni import AsyncOmni  # noqa: E402
from omni_runtime.entrypoints.omni import Omni  # noqa: E402
from omni_runtime.exceptions import *  # noqa: E402, F403
from omni_runtime.outputs import OmniRequestOutput, StageResult  # noqa: E402
from omni_runtime.params import (  # noqa: E402
    DiffusionSamplingParams,
    EchoSamplingParams,
    TextSamplingParams,
)

__all__ = [
    "AsyncOmni",
    "DeployConfig",
    "DiffusionSamplingParams",
    "EchoSamplingParams",
    "Omni",
    "OmniRequestOutput",
    "StageResult",
    "TextSamplingParams",
    "load_config",
]
