"""What the diffusion runner reads off a pipeline without loading one: whether it takes lists,
its native size and its size step (from fakes with a pipeline's attributes)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace as NS
from typing import Any


def diffusion():
    # Imported in the tests, not at the top: a unit module loads no torch at collection.
    from omni_runtime.stage.runners import diffusion

    return diffusion


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
    assert diffusion().native_size(fake_pipe(2, unet=unet, default_sample_size=32)) == (64, 64)
    assert diffusion().native_size(fake_pipe(8, unet=NS(config=NS(sample_size=(96, 64))))) == (768, 512)
    # A transformer's sample size wins over a pipeline constant; without one, the VAE's own size.
    dit = NS(config=NS(sample_size=4, patch_size=1))
    assert diffusion().native_size(fake_pipe(32, transformer=dit, default_sample_size=32)) == (128, 128)
    flux = NS(config=NS(patch_size=1))
    vae = NS(config=NS(sample_size=64))
    assert diffusion().native_size(fake_pipe(2, 4, transformer=flux, vae=vae, default_sample_size=128)) == (64, 64)
    assert diffusion().native_size(fake_pipe(8, transformer=flux, default_sample_size=128)) == (1024, 1024)
    assert diffusion().native_size(fake_pipe(8)) == (None, None)


def test_size_multiple_is_vae_factor_times_patch_and_at_least_8() -> None:
    assert diffusion().size_multiple(fake_pipe(2, unet=NS(config=NS(sample_size=32)))) == 8
    assert diffusion().size_multiple(fake_pipe(8, transformer=NS(config=NS(patch_size=2)))) == 16  # SD3, PixArt
    assert diffusion().size_multiple(fake_pipe(32, transformer=NS(config=NS(patch_size=1)))) == 32  # Sana
    assert diffusion().size_multiple(fake_pipe(8, 16, transformer=NS(config=NS(patch_size=1)))) == 16  # Flux packs 2x2
    assert diffusion().size_multiple(NS()) == 8
