"""Image inputs of the diffusion runner: which pipeline serves a request, and what it is given.

A loaded model directory is one diffusers pipeline, but a request may want one of three forms:

- ``text``: text-to-image (no input image);
- ``image``: img2img or edit (an input ``image``, optionally ``strength``);
- ``inpaint``: inpainting (``image`` and ``mask_image``).

:class:`PipelineForms` takes the loaded pipeline as the form it is, and makes the other forms with
``from_pipe``, which shares the loaded components (no second copy of the weights): for a pipeline
of a registered family, that of the form's class its spec names (``FamilySpec.image_forms``); for
one of no registered family, diffusers' ``AutoPipelineFor*``. They are made at load, not on the
first image request: the stage's READY message then says exactly which inputs it takes (the caller
refuses the rest with a 400), the first image request pays nothing extra, and the forward thread
never builds pipelines. So a text-to-image directory also serves img2img and inpainting, and an
img2img directory also serves text-to-image, wherever its family has the matching pipeline.

A pipeline that needs inputs this runtime cannot supply (a ControlNet's or T2I-Adapter's
conditioning image, a Flux Control ``control_image``) is refused at load with a ConfigError
instead of failing every request later.

Runs in the stage worker: ``PipelineForms`` is built in ``load()``, the call arguments are made in
the forward thread.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.exceptions import ConfigError
from omni_runtime.messages import StageConstraints
from omni_runtime.models.families import FamilySpec, families, for_form
from omni_runtime.params import DiffusionSamplingParams
from omni_runtime.stage.runners.base import RunnerRequest
from omni_runtime.stage.runners.sizes import denoiser

logger = logging.getLogger(__name__)

TEXT, IMAGE, INPAINT = "text", "image", "inpaint"
#: Components whose inputs (a conditioning image per request) the runtime has no param for.
CONDITIONING_COMPONENTS = ("controlnet", "adapter")
#: ``__call__`` parameters the runtime has no param for, and a pipeline cannot run without.
CONDITIONING_PARAMS = ("control_image", "control_mask")


def form_channels(pipeline: str) -> tuple[int, ...] | None:
    """Denoiser input channels a derived pipeline checks in its ``__call__`` (so would fail every
    request), from any family spec's ``form_channels`` (for a pipeline of no registered family that
    diffusers maps to a family's form): SD3's inpainting pipeline takes SD3's 16 latent channels (or
    a 33-channel inpainting model) only."""
    return next((f.form_channels[pipeline] for f in families() if pipeline in f.form_channels), None)


@dataclass
class PipelineForm:
    """One form of the loaded model, with the facts of its ``__call__``."""

    kind: str
    pipe: Any
    call_params: dict[str, inspect.Parameter] = field(default_factory=dict)
    #: Its ``__call__`` takes one input image, not a list (Wan image-to-video): each request is
    #: then one call of its own, its image given once for all its outputs.
    single_image: bool = False

    def default(self, name: str, fallback: Any = None) -> Any:
        param = self.call_params.get(name)
        if param is None or param.default is inspect.Parameter.empty:
            return fallback
        return param.default


def kind_of(params: DiffusionSamplingParams) -> str:
    """The form a request needs, from its (validated) params."""
    if params.image is None:
        return TEXT
    return INPAINT if params.mask_image is not None else IMAGE


def unsuppliable_inputs(pipe: Any) -> str | None:
    """Why the runtime cannot drive ``pipe``'s ``__call__`` (inputs it has no param for), or None."""
    name = type(pipe).__name__
    components = getattr(pipe, "components", {}) or {}
    for component in CONDITIONING_COMPONENTS:
        if components.get(component) is not None:
            return (
                f"{name} needs a per-request conditioning image for its `{component}`, which this runtime has no "
                "param for; serve the base text-to-image/img2img model directory instead"
            )
    call = inspect.signature(type(pipe).__call__).parameters
    for param in CONDITIONING_PARAMS:
        if param in call:
            return f"{name} needs `{param}`, which this runtime has no param for"
    return None


def _own_kind(pipe: Any) -> tuple[str, bool]:
    """(the form ``pipe`` is, whether it needs an input image): a pipeline that takes an image but
    that diffusers also lists as text-to-image (Flux Kontext) takes one optionally."""
    from diffusers.pipelines.auto_pipeline import AUTO_TEXT2IMAGE_PIPELINES_MAPPING

    call = inspect.signature(type(pipe).__call__).parameters
    if "mask_image" in call and "image" in call:
        return INPAINT, True
    if "image" in call:
        optional = any(cls.__name__ == type(pipe).__name__ for cls in AUTO_TEXT2IMAGE_PIPELINES_MAPPING.values())
        return IMAGE, not optional
    return TEXT, False


class PipelineForms:
    """The forms (text, image, inpaint) one loaded model serves, made once at load."""

    def __init__(self, loaded: Any) -> None:
        problem = unsuppliable_inputs(loaded)
        if problem:
            raise ConfigError(problem)
        self.loaded_name = type(loaded).__name__
        #: The family whose spec names the other forms' classes; None: diffusers' AutoPipeline.
        self.family = for_form(self.loaded_name)
        logging.getLogger("diffusers.models.modeling_utils").addFilter(_NO_EMPTY_FP32_WARNING)
        own, needs_image = _own_kind(loaded)
        self.forms: dict[str, PipelineForm] = {}
        self._add(own, loaded)
        if own == IMAGE and not needs_image:  # an edit pipeline that also draws from text alone
            self._add(TEXT, loaded)
        #: Why a form is missing, for the caller's error messages.
        self.missing: dict[str, str] = {}
        # A 9-channel inpainting UNet only runs as an inpainting pipeline.
        channels = getattr(getattr(denoiser(loaded), "config", None), "in_channels", None)
        latent = getattr(getattr(getattr(loaded, "vae", None), "config", None), "latent_channels", None)
        inpaint_only = own == INPAINT and channels is not None and latent is not None and channels > latent
        for kind in (TEXT, IMAGE, INPAINT):
            if kind in self.forms:
                continue
            if inpaint_only:
                self.missing[kind] = f"{self.loaded_name} has an inpainting-only denoiser ({channels} input channels)"
                continue
            derived, why = _derive(loaded, kind, self.family)
            if derived is not None:
                self._add(kind, derived)
            else:
                self.missing[kind] = why
        logger.info(
            "%s serves %s%s",
            self.loaded_name,
            ", ".join(f"{k} ({type(f.pipe).__name__})" for k, f in self.forms.items()),
            "".join(f"; no {k}: {why}" for k, why in self.missing.items()),
        )

    def _add(self, kind: str, pipe: Any) -> None:
        params = dict(inspect.signature(type(pipe).__call__).parameters)
        self.forms[kind] = PipelineForm(kind, pipe, params, bool(getattr(type(pipe), "single_image", False)))

    @property
    def text(self) -> PipelineForm | None:
        return self.forms.get(TEXT)

    def form(self, params: DiffusionSamplingParams) -> PipelineForm:
        kind = kind_of(params)
        found = self.forms.get(kind)
        if found is None:  # refused by the caller's check_constraints; a direct call still gets a clear error
            raise ValueError(f"this model has no {kind} pipeline: {self.missing.get(kind, 'unknown')}")
        return found

    def constraints(self) -> StageConstraints:
        """What the caller checks before enqueue (see ``params.check_image_capability``): the
        image fields of the stage's constraints, the others left unset."""
        accepted = [name for name, kind in (("image", IMAGE), ("mask_image", INPAINT)) if kind in self.forms]
        if INPAINT in self.forms and "image" not in accepted:
            accepted.insert(0, "image")
        # The pipelines' own default strengths, so the caller can check that a request runs at
        # least one denoising step (num_inference_steps x strength >= 1).
        strengths = {k: f.default("strength") for k, f in self.forms.items() if k != TEXT}
        notes = [
            f"no {'img2img' if k == IMAGE else k}: {self.missing[k]}" for k in (IMAGE, INPAINT) if k in self.missing
        ]
        return StageConstraints(
            image_inputs=tuple(accepted),
            default_strength={k: float(v) for k, v in strengths.items() if isinstance(v, int | float)},
            image_inputs_note="; ".join(notes) if notes else None,
            requires_image=None
            if TEXT in self.forms
            else f"{self.loaded_name} edits images: it needs an input image ({self.missing.get(TEXT, 'no text form')})",
        )

    def key(self, params: DiffusionSamplingParams) -> Hashable:
        """The image part of the batch key: the form, the input's shape, mask presence and the
        strength with the pipeline's default resolved (a wave runs one pipeline call)."""
        kind = kind_of(params)
        if kind == TEXT:
            return (TEXT,)
        form = self.forms.get(kind)
        strength = params.strength
        if strength is None and form is not None:
            strength = form.default("strength")
        return (kind, tuple(params.image.shape), params.mask_image is not None, strength)


class _NoEmptyFp32Warning(logging.Filter):
    """Drops diffusers' "modules that should be kept in float32: []" warning: SDXL's img2img and
    inpainting pipelines cast their VAE to float32 on every call, and with an empty list there is
    nothing to keep, so the warning would only repeat in the server log once per request."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "should be kept in float32: []" not in record.getMessage()


_NO_EMPTY_FP32_WARNING = _NoEmptyFp32Warning()


def _derive(loaded: Any, kind: str, family: FamilySpec | None) -> tuple[Any | None, str]:
    """``loaded`` as the pipeline of another form (shared components), or (None, why not): the
    form's class in ``family``'s spec, or diffusers' ``AutoPipelineFor*`` for no family."""
    if family is not None:
        cls: Any = family.load_form_class(kind)  # a diffusers pipeline class (from_pipe)
        if cls is None:
            return None, f"{type(loaded).__name__}'s family ({family.name}) has no {kind} pipeline"
        try:
            derived = _from_pipe(cls, loaded)
        except Exception as e:
            return None, f"{cls.__name__} cannot be made from {type(loaded).__name__} ({type(e).__name__}: {e})"
    else:
        import diffusers

        auto = {
            TEXT: diffusers.AutoPipelineForText2Image,
            IMAGE: diffusers.AutoPipelineForImage2Image,
            INPAINT: diffusers.AutoPipelineForInpainting,
        }[kind]
        try:
            derived = auto.from_pipe(loaded)
        except Exception as e:  # diffusers raises ValueError for a family without that form
            return None, f"diffusers has no {kind} pipeline for {type(loaded).__name__} ({type(e).__name__}: {e})"
    if type(derived).__name__ == type(loaded).__name__:
        return None, f"{type(loaded).__name__} maps to itself for {kind}"
    channels = getattr(getattr(denoiser(derived), "config", None), "in_channels", None)
    allowed = family.form_channels.get(type(derived).__name__) if family is not None else None
    allowed = allowed or form_channels(type(derived).__name__)
    if allowed and channels not in allowed:
        return None, f"{type(derived).__name__} needs a denoiser of {' or '.join(map(str, allowed))} input channels"
    if unsuppliable_inputs(derived):
        return None, f"its {kind} pipeline {type(derived).__name__} needs inputs this runtime cannot supply"
    derived.set_progress_bar_config(disable=True)
    return derived, ""


def _from_pipe(cls: Any, loaded: Any) -> Any:
    """A ``cls`` pipeline of ``loaded``'s modules (shared, not copied) and the config entries its
    constructor takes, as ``AutoPipelineFor*.from_pipe`` makes one. Not ``cls.from_pipe``: that
    casts every shared module to one dtype (float32 unless told), so the loaded model would change
    dtype, modules a model keeps in float32 included."""
    init = inspect.signature(cls.__init__).parameters
    modules, options = cls._get_signature_keys(cls)
    kwargs = {name: module for name, module in loaded.components.items() if name in modules}
    kwargs.update({name: value for name, value in loaded.config.items() if name in options})
    optional = set(cls._optional_components) | {n for n in modules if init[n].default is not inspect.Parameter.empty}
    if missing := set(modules) - optional - set(kwargs):
        raise ValueError(f"{type(loaded).__name__} has no {', '.join(sorted(missing))}")
    return cls(**kwargs)


def image_call_kwargs(
    batch: list[RunnerRequest[DiffusionSamplingParams]], form: PipelineForm, per_prompt: int
) -> dict[str, Any]:
    """The image arguments of one pipeline call, one row per output image (prompt-major: a
    request's ``per_prompt`` rows together), as the caller's prompts are then repeated too.

    Images go to the pipeline as PIL images, as diffusers users pass them (its image processor
    normalises them identically whatever the batch); a request's own generator of each row
    encodes and noises that row, so a result does not depend on its batch-mates.
    """
    from PIL import Image

    kwargs: dict[str, Any] = {
        "image": [Image.fromarray(r.params.image) for r in batch for _ in range(per_prompt)],
    }
    if form.kind == INPAINT:
        kwargs["mask_image"] = [Image.fromarray(r.params.mask_image) for r in batch for _ in range(per_prompt)]
    strength = batch[0].params.strength
    if strength is not None:
        kwargs["strength"] = strength
    # Flux Kontext resizes its input to one of the real model's preferred sizes (about 1 MP): the
    # output would not have the size the request was batched and checked by.
    if "_auto_resize" in form.call_params:
        kwargs["_auto_resize"] = False
    return {k: v for k, v in kwargs.items() if k in form.call_params}


def size_kwargs(call_params: dict[str, inspect.Parameter], height: int | None, width: int | None) -> dict[str, Any]:
    """Arguments that keep a pipeline at the requested size: Flux Kontext scales every output to
    ``max_area`` (the real model's 1024^2 by default) whatever ``height`` / ``width`` say."""
    if "max_area" in call_params and height and width:
        return {"max_area": height * width}
    return {}
