"""What the diffusion runner reads off a pipeline without loading one: whether it takes lists,
its native size and its size step (from fakes with a pipeline's attributes), and how a family's
spec changes those rules (its floor, packing, a ``limits`` hook of its own, its callback style)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace as NS
from typing import Any


def diffusion():
    # Imported in the tests, not at the top: a unit module loads no torch at collection.
    from omni_runtime.stage.runners import diffusion

    return diffusion


def sizes():
    from omni_runtime.stage.runners import sizes

    return sizes


def test_batched_inputs_are_read_from_the_call_signature() -> None:
    def lists(prompt: str | list[str], generator: Any | list[Any] | None = None): ...
    def scalar(prompt: str, generator: Any = None): ...
    def no_generator(prompt: str | list[str]): ...
    def untyped(prompt, generator=None): ...

    assert diffusion().accepts_batched_inputs(inspect.signature(lists))
    assert not diffusion().accepts_batched_inputs(inspect.signature(scalar))
    assert not diffusion().accepts_batched_inputs(inspect.signature(no_generator))
    assert diffusion().accepts_batched_inputs(inspect.signature(untyped))


def fake_pipe(scale: int = 8, processor_scale: int | None = None, **parts: object) -> NS:
    """The attributes of a pipeline that native_size and size_multiple read."""
    processor = NS(config=NS(vae_scale_factor=processor_scale or scale))
    return NS(vae_scale_factor=scale, image_processor=processor, **parts)


def test_native_size_comes_from_the_model_configs() -> None:
    unet = NS(config=NS(sample_size=32))
    assert sizes().native_size(fake_pipe(2, unet=unet, default_sample_size=32)) == (64, 64)
    assert sizes().native_size(fake_pipe(8, unet=NS(config=NS(sample_size=(96, 64))))) == (768, 512)
    # A transformer's sample size wins over a pipeline constant; without one, the VAE's own size.
    dit = NS(config=NS(sample_size=4, patch_size=1))
    assert sizes().native_size(fake_pipe(32, transformer=dit, default_sample_size=32)) == (128, 128)
    flux = NS(config=NS(patch_size=1))
    vae = NS(config=NS(sample_size=64))
    assert sizes().native_size(fake_pipe(2, 4, transformer=flux, vae=vae, default_sample_size=128)) == (64, 64)
    assert sizes().native_size(fake_pipe(8, transformer=flux, default_sample_size=128)) == (1024, 1024)
    assert sizes().native_size(fake_pipe(8)) == (None, None)


def test_size_multiple_is_vae_factor_times_patch_and_at_least_8() -> None:
    assert sizes().size_multiple(fake_pipe(2, unet=NS(config=NS(sample_size=32)))) == 8
    assert sizes().size_multiple(fake_pipe(8, transformer=NS(config=NS(patch_size=2)))) == 16  # SD3, PixArt
    assert sizes().size_multiple(fake_pipe(32, transformer=NS(config=NS(patch_size=1)))) == 32  # Sana
    assert sizes().size_multiple(fake_pipe(8, 16, transformer=NS(config=NS(patch_size=1)))) == 16  # Flux packs 2x2
    assert sizes().size_multiple(NS()) == 8


def video_limits(pipe: object) -> Any:
    """A ``limits`` hook as a family with rules of its own (a video family) would write one."""
    return sizes().SizeLimits(multiple=16, reason="the VAE scale factor 8 x the patch size 2", native=(480, 832))


def test_a_family_spec_rules_the_size_step() -> None:
    from omni_runtime.models.families import FamilySpec

    dit = fake_pipe(8, transformer=NS(config=NS(patch_size=2, sample_size=8)))
    plain = FamilySpec("plain", ("PlainPipeline",), "T").size_limits(dit)
    assert plain == sizes().derive_size_limits(dit)  # the defaults are the generic rule
    assert plain.multiple == 16 and plain.native == (64, 64)
    # A family whose pipeline takes multiples of 48 only: the step follows its floor.
    floored = FamilySpec("floored", ("FlooredPipeline",), "T", size_floor=48).size_limits(dit)
    assert floored.multiple == 48 and floored.reason.endswith("and the pipeline takes multiples of 48 only")
    # Packing is the spec's, not the image processor's (which says 8 here).
    packed = FamilySpec("packed", ("PackedPipeline",), "T", latent_packing=2).size_limits(dit)
    assert packed.multiple == 32 and "latent packing x2" in packed.reason
    # A family with rules of its own names a hook, and the runner takes what it returns.
    hooked = FamilySpec("video", ("VideoPipeline",), "T", limits=f"{__name__}:video_limits").size_limits(dit)
    assert hooked == video_limits(dit)


def test_callback_style_of_an_unregistered_pipeline_is_read_from_its_signature() -> None:
    def modern(prompt, callback_on_step_end=None): ...
    def legacy(prompt, callback=None, callback_steps=1): ...
    def plain(prompt): ...

    style = diffusion().callback_style
    assert style(dict(inspect.signature(modern).parameters)) == "on_step_end"
    assert style(dict(inspect.signature(legacy).parameters)) == "legacy"
    assert style(dict(inspect.signature(plain).parameters)) == "none"
