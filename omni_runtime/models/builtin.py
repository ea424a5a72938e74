"""``builtin:<name>`` models: tiny random-weight pipelines built offline from seeded configs.

Each is built once into a cache directory (``$OMNI_RUNTIME_CACHE``, default
``~/.cache/omni_runtime``) and then always loaded with the libraries' own ``from_pretrained`` from
that directory, the same path a real model takes. Two processes using a model for the first time
at once are serialised by a file lock, and a build is published by an atomic rename, so a reader
never sees a half-written directory.
"""

from __future__ import annotations

import fcntl
import importlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from omni_runtime.exceptions import ConfigError
from omni_runtime.models.families import builders as family_builders

#: Builtins that belong to no diffusion family: name -> "module:function" that writes the model
#: into an empty directory. The families' own are in their specs (``omni_runtime.models.families``).
OTHER_BUILDERS: dict[str, str] = {
    "tiny-lm": "omni_runtime.models.tiny_lm:build_tiny_lm",
    "tiny-tts": "omni_runtime.models.tiny_tts:build_tiny_tts",
    "tiny-whisper": "omni_runtime.models.tiny_whisper:build_tiny_whisper",
    "tiny-qwen-omni": "omni_runtime.models.tiny_qwen_omni:build_tiny_qwen_omni",
}


def builders() -> dict[str, str]:
    """Every builtin model: name -> "module:function" that writes it into an empty directory."""
    return {**family_builders(), **OTHER_BUILDERS}


#: Bumped when a builder changes, so stale caches are not reused.
CACHE_VERSION = "v1"


def cache_dir() -> Path:
    return Path(os.environ.get("OMNI_RUNTIME_CACHE") or Path.home() / ".cache" / "omni_runtime")


def builtin_names() -> list[str]:
    return sorted(builders())


def builder(name: str) -> Callable[[Path], None]:
    module, _, func = builders()[name].partition(":")
    return getattr(importlib.import_module(module), func)


def ensure_builtin(name: str) -> Path:
    """The local directory of builtin model ``name``, building it on first use."""
    if name not in builders():
        raise ConfigError(f"unknown builtin model {name!r}; expected one of {', '.join(builtin_names())}")
    root = cache_dir()
    target = root / f"{name}-{CACHE_VERSION}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if target.is_dir():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            builder(name)(tmp)
            os.rename(tmp, target)  # atomic: readers see all of it or nothing
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def resolve_model(spec: str) -> str:
    """A ``model:`` value as a local directory: ``builtin:<name>`` or an existing path."""
    if spec.startswith("builtin:"):
        return str(ensure_builtin(spec.removeprefix("builtin:")))
    path = Path(spec).expanduser()
    if not path.exists():
        raise ConfigError(
            f"model directory not found: {spec} (models are loaded from local "
            "directories; use builtin:<name> for a bundled tiny model)"
        )
    return str(path.resolve())
