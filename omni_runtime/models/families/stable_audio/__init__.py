"""Stable Audio Open text-to-audio: a T5 encoder and the clip's start and end seconds condition a
1-D DiT over the latents of the Oobleck autoencoder. The DiT denoises a fixed window of latents
(``transformer.sample_size``); the decoded waveform is cut to ``[audio_start_in_s, audio_end_in_s)``,
so a request's length is at most that window's duration."""

from __future__ import annotations

from typing import Any

from omni_runtime.models.families import FamilySpec, register
from omni_runtime.stage.runners.sizes import SizeLimits


def stable_audio_limits(pipe: Any) -> SizeLimits:
    """An audio model has no image size; its length rule is the DiT's latent window x the VAE's
    samples per latent (``hop_length``) at the VAE's sample rate."""
    rate = int(pipe.vae.config.sampling_rate)
    window = int(pipe.transformer.config.sample_size)
    hop = int(pipe.vae.hop_length)
    return SizeLimits(
        multiple=1,
        reason="an audio model has no image size",
        native=(None, None),
        sample_rate=rate,
        max_audio_s=window * hop / rate,
        audio_reason=(
            f"the {type(pipe.transformer).__name__}'s window of {window} latents x {hop} samples per latent "
            f"at {rate} Hz"
        ),
    )


SPEC = register(
    FamilySpec(
        name="stable_audio",
        pipelines=("StableAudioPipeline",),
        denoiser="StableAudioDiTModel",
        output="audio",
        builders={"tiny-stable-audio": "omni_runtime.models.families.stable_audio.tiny:build_tiny_stable_audio"},
        tiny="tiny-stable-audio",
        limits="omni_runtime.models.families.stable_audio:stable_audio_limits",
        # StableAudioPipeline calls back with callback(step, timestep, latents).
        callback="legacy",
        fixed_kwargs={},
        golden=(-0.1371, -0.0245, -0.0429, -0.1283, -0.5318, -0.6971, -0.5102, -0.4768),
    )
)
