"""The sizes a loaded diffusion pipeline makes: its size step, why, and its native size.

A registered family's spec says how its sizes are ruled (``FamilySpec.size_limits``: a floor, a
latent packing, or a ``limits`` hook of its own); :func:`derive_size_limits` is the rule for the
image families here and the fallback for a pipeline of no registered family, read from the
pipeline's components' configs. Imports no torch: it only reads attributes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: The step a pipeline of no registered family is held to at least: the diffusers image
#: pipelines' ``check_inputs`` reject sizes that are not multiples of 8.
DEFAULT_SIZE_FLOOR = 8
#: The default ``max_pixels`` is this many times the model's native area (its configs' size, or
#: the stage's default size for a model whose configs state none).
NATIVE_AREA_FACTOR = 4


@dataclass(frozen=True)
class SizeLimits:
    """What the runner reports of a loaded model's sizes (the ``size_multiple``,
    ``size_multiple_reason`` and ``native_size`` constraints).

    A family with other rules returns its own from its spec's ``limits`` hook. A video family
    computes ``multiple`` from its VAE's spatial factor x its transformer's patch size, and its
    frame rule (``num_frames = 4k + 1`` for a VAE that compresses time 4x) in the frame fields; an
    image model leaves those None.
    """

    #: Height and width must be multiples of it.
    multiple: int
    #: Why, in the model's terms (for the 400 a user gets).
    reason: str
    #: The (height, width) the model was made for, in pixels; (None, None) if unknown.
    native: tuple[int | None, int | None]
    #: The longest height or width the denoiser can place (its positional table's length in
    #: patches x the size step), and why; None: no such limit.
    max_side: int | None = None
    max_side_reason: str | None = None
    #: A video model makes ``frames_step * k + 1`` frames (its VAE's temporal compression); None:
    #: the model makes images.
    frames_step: int | None = None
    #: Why, in the model's terms.
    frames_reason: str | None = None
    #: Most frames it can make (its positional table's length in latent frames); None: no limit.
    max_frames: int | None = None
    #: An audio model's sample rate (Hz); None: the model makes images or videos.
    sample_rate: int | None = None
    #: The longest clip an audio model makes, in seconds (its latent window), and why.
    max_audio_s: float | None = None
    audio_reason: str | None = None


def derive_size_limits(
    pipe: Any, floor: int = DEFAULT_SIZE_FLOOR, packing: int | None = None, position_table: str | None = None
) -> SizeLimits:
    """The size rules of ``pipe``: step = lcm(``floor``, VAE scale factor x latent packing x the
    denoiser's patch size). ``packing`` None reads it off the pipeline's image processor, whose
    scale includes it (Flux's processor works in VAE factor x 2). ``position_table`` names the
    denoiser config key holding its positional table's length per side, in patches (SD3's
    ``pos_embed_max_size``): a side is then at most that many patches (``max_side``)."""
    vae, scale, patch = _size_factors(pipe, packing)
    parts = [f"the VAE scale factor {vae}"]
    if scale != vae:
        parts.append(f"latent packing x{scale // vae}")
    if patch > 1:
        parts.append(f"the {type(denoiser(pipe)).__name__} patch size {patch}")
    reason = " x ".join(parts)
    multiple = math.lcm(floor, scale * patch)
    if multiple != scale * patch:
        reason += f", and the pipeline takes multiples of {floor} only"
    module = denoiser(pipe)
    table = getattr(getattr(module, "config", None), position_table, None) if position_table else None
    return SizeLimits(
        multiple=multiple,
        reason=reason,
        native=native_size(pipe),
        # A side past the table fails inside the denoiser (tiny-sd3: 8 x 512, 128 patches of a
        # 64-patch table).
        max_side=int(table) * scale * patch if table else None,
        max_side_reason=(
            f"the {type(module).__name__} positional table of {int(table)} patches per side x "
            f"{scale * patch} pixels a patch"
            if table
            else None
        ),
    )


def size_multiple(pipe: Any) -> int:
    """The step of the sizes a pipeline of no registered family can make (:func:`derive_size_limits`)."""
    return derive_size_limits(pipe).multiple


def size_multiple_reason(pipe: Any) -> str:
    """Why sizes must be multiples of :func:`size_multiple`, in the model's own terms."""
    return derive_size_limits(pipe).reason


def _size_factors(pipe: Any, packing: int | None = None) -> tuple[int, int, int]:
    """The VAE scale factor, the latent scale (the VAE's x the packing) and the denoiser's patch size."""
    vae = int(getattr(pipe, "vae_scale_factor", None) or 8)
    if packing is None:
        processor = getattr(getattr(pipe, "image_processor", None), "config", None)
        scale = int(getattr(processor, "vae_scale_factor", None) or vae)
    else:
        scale = vae * packing
    patch = int(getattr(getattr(denoiser(pipe), "config", None), "patch_size", None) or 1)
    return vae, scale, patch


def native_size(pipe: Any) -> tuple[int | None, int | None]:
    """The size a pipeline's model was made for, in pixels, from its components' configs.

    1) the denoiser's ``sample_size`` (in latent pixels) x the VAE scale factor (SD, SDXL, SD3,
       PixArt, Sana); 2) else the VAE's own ``sample_size`` in pixels (Flux's transformer has
       none); 3) else the pipeline's ``default_sample_size``. Signature defaults are not used:
       Sana's says 1024 and Flux's 128 x VAE factor, whatever model is loaded.
    """
    scale = int(getattr(pipe, "vae_scale_factor", None) or 8)
    sample = getattr(getattr(denoiser(pipe), "config", None), "sample_size", None)
    if sample:
        return _pair(sample, scale)
    vae_sample = getattr(getattr(getattr(pipe, "vae", None), "config", None), "sample_size", None)
    if vae_sample:
        return _pair(vae_sample, 1)
    default = getattr(pipe, "default_sample_size", None)
    return _pair(default, scale) if default else (None, None)


def denoiser(pipe: Any) -> Any:
    """The pipeline's denoiser: its ``unet``, else its ``transformer`` (None if neither)."""
    unet = getattr(pipe, "unet", None)
    return unet if unet is not None else getattr(pipe, "transformer", None)


def _pair(size: Any, scale: int) -> tuple[int, int]:
    if isinstance(size, list | tuple):
        return int(size[0]) * scale, int(size[1]) * scale
    return int(size) * scale, int(size) * scale
