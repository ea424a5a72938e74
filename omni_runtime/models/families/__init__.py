"""Model families: one package per family, one :class:`FamilySpec` each, one lazy registry.

A family package (``omni_runtime/models/families/<family>/``) holds its spec in ``__init__.py``,
its tiny builder in ``tiny.py`` and its step loop in ``steps.py``. The spec names code by
``"module:attr"`` strings, so reading the registry imports no diffusers class: the step loop,
the builder and a pipeline class outside diffusers are imported when first used.

Everything that knows a family reads its spec: the diffusion runner (pipeline class, size rules,
fixed call arguments, callback style, image-input forms, step loop), the stage-type registry (the
stage types a family brings), the builtin models (builders), and the family tests (sizes,
denoiser, image forms, golden slice). The runner derives these facts from the pipeline itself only
for a pipeline of no registered family. A family from outside this package is registered with
:func:`register`, from a module that a stage names in ``runner_args: {families: [module]}`` (it
is imported in the stage process before the model loads) or that the caller imports first.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from omni_runtime.stage.runners.core_stage_types import BUILTIN_RUNNERS, StageType
from omni_runtime.stage.runners.sizes import SizeLimits, derive_size_limits

#: The families this package holds, in registration order.
BUILTIN_FAMILIES = ("sd", "sdxl", "sd3", "flux", "pixart", "sana", "wan", "ltx", "stable_audio")

#: Pipeline call arguments that would change what is asked for, turned off where a pipeline has
#: them: ``clean_caption`` (PixArt, Sana) rewrites the prompt and needs packages this runtime does
#: not carry; ``use_resolution_binning`` (PixArt, Sana) denoises at the nearest size of the real
#: models' aspect-ratio table and resizes afterwards (a tiny model's sizes are not in it, the work
#: done would not be the size the batch key groups by). Also what a pipeline of no registered
#: family gets.
DEFAULT_FIXED_KWARGS: Mapping[str, Any] = MappingProxyType({"clean_caption": False, "use_resolution_binning": False})

#: How a family's pipelines call back after each denoising step (the runner's abort check and
#: progress): ``on_step_end`` — ``callback_on_step_end(pipe, step, timestep, kwargs)``, with
#: progress; ``legacy`` — ``callback(step, timestep, latents)`` with ``callback_steps=1``, with
#: progress too; ``none`` — no per-step hook (a wave runs to its end once started).
CallbackStyle = Literal["on_step_end", "legacy", "none"]


@dataclass(frozen=True)
class FamilySpec:
    """All a family is to this runtime."""

    name: str
    #: diffusers pipeline class names it serves (exact: a subclass may change the loop).
    pipelines: tuple[str, ...]
    #: Its denoiser's class name (``pipe.unet`` or ``pipe.transformer``).
    denoiser: str
    #: What its pipelines make: ``image`` (``NxHxWx3``), ``video`` (``NxFxHxWx3``, read from the
    #: output's ``frames``; the runner passes ``num_frames`` and makes video items) or ``audio``
    #: (``N x channels x n``, read from the output's ``audios``; the runner passes the clip's
    #: seconds and makes audio items at the rate its ``limits`` hook reports).
    output: Literal["image", "video", "audio"] = "image"
    #: A video family's frame rate when a request names none.
    fps: int | None = None
    #: ``builtin:<name>`` models -> ``"module:function"`` writing one into an empty directory.
    builders: Mapping[str, str] = field(default_factory=dict)
    #: The builtin the family tests and golden slice use (also its bundled config's name).
    tiny: str | None = None
    #: The tiny builtin's native size (pixels, square) and size step, as the runner reports them
    #: for it (the tests' expectations: a family serves models of many sizes, so the runner reads
    #: a loaded model's from its configs, by the rules below).
    native_size: int = 64
    size_multiple: int = 8
    #: Sizes the family's pipelines take are multiples of this whatever the model (their
    #: ``check_inputs``: 8 for SD, SDXL, SD3, Flux, PixArt; 32 for Sana); the runner's size step
    #: is the least common multiple of it and VAE factor x ``latent_packing`` x patch size.
    size_floor: int = 8
    #: Latent pixels packed into one token per side (Flux packs 2x2: 2), a factor of the size
    #: step that no component config states.
    latent_packing: int = 1
    #: The denoiser config key holding its positional table's length per side, in patches (SD3's
    #: ``pos_embed_max_size``): a side past it x the size step's factors fails inside the model,
    #: so it bounds ``max_side``; None: positions are computed for any size.
    position_table: str | None = None
    #: ``"module:function"`` ``(pipe) -> SizeLimits`` replacing the rules above, for a family whose
    #: sizes follow others (a video family: its VAE's spatial factor x patch, its native size and
    #: frame count from its transformer config).
    limits: str | None = None
    #: How its pipelines call back after each step (see :data:`CallbackStyle`).
    callback: CallbackStyle = "on_step_end"
    #: Call arguments pinned where the pipeline takes them.
    fixed_kwargs: Mapping[str, Any] = field(default_factory=lambda: DEFAULT_FIXED_KWARGS)
    #: ``"module:Class"`` of its :class:`~omni_runtime.stage.runners.diffusion_steps.StepFamily`
    #: (step execution), or None: served request by request only.
    steps: str | None = None
    #: Its image-input forms: ``image`` (img2img) and ``mask`` (inpainting) -> the pipeline class
    #: (a diffusers class name, or ``"module:Class"``), built from the loaded one with that class's
    #: ``from_pipe`` (shared modules); absent or None: the family has none.
    image_forms: Mapping[str, str | None] = field(default_factory=dict)
    #: A form pipeline -> the denoiser input channels it takes (a model with other channels does
    #: not get that form: SD3's inpainting takes 16 or 33, the tiny SD3 has 4).
    form_channels: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    #: Stage types it brings: builtin ``stage_type`` name -> its :class:`StageType` (the runner as
    #: ``"module:Class"``, imported only in the stage process); read by the stage-type registry.
    stage_types: Mapping[str, StageType] = field(default_factory=dict)
    #: ``"module:Class"`` of a pipeline class outside diffusers (diffusers' own are found by
    #: ``model_index.json``'s ``_class_name``).
    pipeline_class: str | None = None
    #: The tiny builtin's output for the golden test: ``images[0, -3:, -3:, -1]`` (float, np)
    #: of GOLDEN_PROMPT with GOLDEN_PARAMS and its bundled defaults (a video family: of its
    #: last frame, ``videos[0, -1, -3:, -3:, -1]``; an audio family: the last samples of each
    #: channel, ``audios[0, :, -4:]``).
    golden: tuple[float, ...] = ()

    def step_class(self) -> type | None:
        return _load(self.steps) if self.steps else None

    def load_pipeline_class(self) -> type | None:
        return _load(self.pipeline_class) if self.pipeline_class else None

    def size_limits(self, pipe: Any) -> SizeLimits:
        """The size rules of a loaded pipeline of this family: its ``limits`` hook, or the
        generic derivation with this family's floor, packing and positional table."""
        if self.limits:
            limits: SizeLimits = _load(self.limits)(pipe)
            return limits
        return derive_size_limits(
            pipe, floor=self.size_floor, packing=self.latent_packing, position_table=self.position_table
        )

    def form_pipelines(self) -> dict[str, str]:
        """Its pipelines by form (``text``, ``image``, ``inpaint``): the first of ``pipelines``
        and its ``image_forms``."""
        forms = {
            "text": self.pipelines[0],
            "image": self.image_forms.get("image"),
            "inpaint": self.image_forms.get("mask"),
        }
        return {kind: name for kind, name in forms.items() if name}

    def load_form_class(self, kind: str) -> type | None:
        """The pipeline class of form ``kind``: a ``"module:Class"`` or a diffusers class name."""
        name = self.form_pipelines().get(kind)
        if name is None:
            return None
        if ":" in name:
            cls: type = _load(name)
            return cls
        import diffusers

        return getattr(diffusers, name, None)


GOLDEN_PROMPT = "a cup of coffee"
GOLDEN_PARAMS: Mapping[str, Any] = MappingProxyType({"seed": 0, "output_type": "np"})

_REGISTRY: dict[str, FamilySpec] = {}
_LOCK = threading.Lock()
_builtins_loaded = False


def _load(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def register(spec: FamilySpec) -> FamilySpec:
    """Add a family (a module outside this package calls this at import). Its pipelines, builtin
    names and stage types must be new: a second family for a pipeline would make the lookup
    ambiguous, a second runner for a stage type name would make a config mean two things."""
    if clash := set(BUILTIN_RUNNERS) & set(spec.stage_types):
        raise ValueError(f"model family {spec.name!r}: stage type {', '.join(sorted(clash))} already a builtin")
    with _LOCK:
        current = _REGISTRY.get(spec.name)
        if current == spec:
            return spec
        if current is not None:
            raise ValueError(f"model family {spec.name!r} is already registered")
        for other in _REGISTRY.values():
            if clash := (
                (set(other.pipelines) & set(spec.pipelines))
                | (set(other.builders) & set(spec.builders))
                | (set(other.stage_types) & set(spec.stage_types))
            ):
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
    """Every registered family: the builtins in :data:`BUILTIN_FAMILIES` order, then the others as
    they registered, whichever module was imported first (a family's ``tiny`` builder imports its
    package, and with it registers that family ahead of the rest)."""
    _ensure_builtins()
    rank = {name: i for i, name in enumerate(BUILTIN_FAMILIES)}
    return sorted(_REGISTRY.values(), key=lambda spec: rank.get(spec.name, len(rank)))


def family(name: str) -> FamilySpec:
    _ensure_builtins()
    return _REGISTRY[name]


def for_pipeline(class_name: str) -> FamilySpec | None:
    """The family serving pipeline class ``class_name``, or None."""
    return next((f for f in families() if class_name in f.pipelines), None)


def for_form(class_name: str) -> FamilySpec | None:
    """The family one of whose forms (text, img2img, inpainting) is pipeline ``class_name``, or None."""
    found = for_pipeline(class_name)
    if found is not None:
        return found
    return next((f for f in families() if class_name in f.form_pipelines().values()), None)


def stage_types() -> dict[str, StageType]:
    """Every family's builtin stage types: name -> :class:`StageType`."""
    return {name: st for f in families() for name, st in f.stage_types.items()}


def builders() -> dict[str, str]:
    """Every family's ``builtin:<name>`` -> ``"module:function"``."""
    return {name: path for f in families() for name, path in f.builders.items()}


def import_family_modules(modules: list[str] | tuple[str, ...]) -> None:
    """Import modules that register families (``runner_args: {families: [...]}``)."""
    for module in modules:
        importlib.import_module(module)
