"""Model families: one package per family, one :class:`FamilySpec` each, one lazy registry.

A family package (``omni_runtime/models/families/<family>/``) holds its spec in ``__init__.py``,
its tiny builder in ``tiny.py`` and its step loop in ``steps.py``. The spec names code by
``"module:attr"`` strings, so reading the registry imports no diffusers class: the step loop,
the builder and a pipeline class outside diffusers are imported when first used.

Everything that knows a family reads its spec: the diffusion runner (pipeline class, fixed call
arguments, step loop), the builtin models (builders), and the family tests (sizes, denoiser,
image forms, golden slice). A family from outside this package is registered with
:func:`register`, from a module that a stage names in ``runner_args: {families: [module]}`` (it
is imported in the stage process before the model loads) or that the caller imports first.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

#: The families this package holds, in registration order.
BUILTIN_FAMILIES = ("sd", "sdxl", "sd3", "flux", "pixart", "sana")

#: Pipeline call arguments that would change what is asked for, turned off where a pipeline has
#: them: ``clean_caption`` (PixArt, Sana) rewrites the prompt and needs packages this runtime does
#: not carry; ``use_resolution_binning`` (PixArt, Sana) denoises at the nearest size of the real
#: models' aspect-ratio table and resizes afterwards (a tiny model's sizes are not in it, the work
#: done would not be the size the batch key groups by). Also what a pipeline of no registered
#: family gets.
DEFAULT_FIXED_KWARGS: Mapping[str, Any] = MappingProxyType({"clean_caption": False, "use_resolution_binning": False})


@dataclass(frozen=True)
class FamilySpec:
    """All a family is to this runtime."""

    name: str
    #: diffusers pipeline class names it serves (exact: a subclass may change the loop).
    pipelines: tuple[str, ...]
    #: Its denoiser's class name (``pipe.unet`` or ``pipe.transformer``).
    denoiser: str
    #: ``builtin:<name>`` models -> ``"module:function"`` writing one into an empty directory.
    builders: Mapping[str, str] = field(default_factory=dict)
    #: The builtin the family tests and golden slice use (also its bundled config's name).
    tiny: str | None = None
    #: The tiny builtin's native size (pixels, square) and size step: VAE factor x patch size
    #: (x 2 for Flux's packing), at least 8. The runner reads both from the loaded model's
    #: configs; these are what the tests expect it to read.
    native_size: int = 64
    size_multiple: int = 8
    #: Call arguments pinned where the pipeline takes them.
    fixed_kwargs: Mapping[str, Any] = field(default_factory=lambda: DEFAULT_FIXED_KWARGS)
    #: ``"module:Class"`` of its :class:`~omni_runtime.stage.runners.diffusion_steps.StepFamily`
    #: (step execution), or None: served request by request only.
    steps: str | None = None
    #: Its image-input forms as diffusers derives them (``AutoPipelineFor*.from_pipe``):
    #: ``image`` (img2img) and ``mask`` (inpainting) pipeline class names, None where it has none.
    image_forms: Mapping[str, str | None] = field(default_factory=dict)
    #: A form pipeline -> the denoiser input channels it takes (a derived form with other
    #: channels is refused: SD3's inpainting takes 16 or 33, the tiny SD3 has 4).
    form_channels: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: ``"module:Class"`` of a pipeline class outside diffusers (diffusers' own are found by
    #: ``model_index.json``'s ``_class_name``).
    pipeline_class: str | None = None
    #: The tiny builtin's output for the golden test: ``images[0, -3:, -3:, -1]`` (float, np)
    #: of GOLDEN_PROMPT with GOLDEN_PARAMS and its bundled defaults.
    golden: tuple[float, ...] = ()

    def step_class(self) -> type | None:
        return _load(self.steps) if self.steps else None

    def load_pipeline_class(self) -> type | None:
        return _load(self.pipeline_class) if self.pipeline_class else None


GOLDEN_PROMPT = "a cup of coffee"
GOLDEN_PARAMS: Mapping[str, Any] = MappingProxyType({"seed": 0, "output_type": "np"})

_REGISTRY: dict[str, FamilySpec] = {}
_LOCK = threading.Lock()
_builtins_loaded = False


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def register(spec: FamilySpec) -> FamilySpec:
    """Add a family (a module outside this package calls this at import). Its pipelines and
    builtin names must be new: a second family for a pipeline would make the lookup ambiguous."""
    with _LOCK:
        current = _REGISTRY.get(spec.name)
        if current == spec:
            return spec
        if current is not None:
            raise ValueError(f"model family {spec.name!r} is already registered")
        for other in _REGISTRY.values():
            if clash := (set(other.pipelines) & set(spec.pipelines)) | (set(other.builders) & set(spec.builders)):
                raise ValueError(f"model family {spec.name!r}: {', '.join(sorted(clash))} already in {other.name!r}")
        _REGISTRY[spec.name] = spec
    return spec


def _ensure_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        for name in BUILTIN_FAMILIES:
            importlib.import_module(f"{__name__}.{name}")  # each registers its spec (strings only)
        _builtins_loaded = True


def families() -> list[FamilySpec]:
    """Every registered family, builtins first."""
    _ensure_builtins()
    return list(_REGISTRY.values())


def family(name: str) -> FamilySpec:
    _ensure_builtins()
    return _REGISTRY[name]


def for_pipeline(class_name: str) -> FamilySpec | None:
    """The family serving pipeline class ``class_name``, or None."""
    return next((f for f in families() if class_name in f.pipelines), None)


def builders() -> dict[str, str]:
    """Every family's ``builtin:<name>`` -> ``"module:function"``."""
    return {name: path for f in families() for name, path in f.builders.items()}


def import_family_modules(modules: list[str] | tuple[str, ...]) -> None:
    """Import modules that register families (``runner_args: {families: [...]}``)."""
    for module in modules:
        importlib.import_module(module)
