"""``builtin:tiny-stable-audio``: a Stable Audio Open text-to-audio pipeline with random (seeded)
weights, built offline.

The real model's layout at toy widths: a T5 encoder whose states, with the clip's start and end
seconds (``StableAudioProjectionModel``), condition a 1-D DiT (``StableAudioDiTModel``) over the
latents of the Oobleck autoencoder, denoised by the cosine-schedule SDE DPM-Solver the real model
ships with. Stereo, as the real model, but at 16 kHz where it runs at 44.1 kHz: the VAE decodes
the whole latent window whatever length is asked for, and a third of the samples keeps a wave
well under a second on a CPU. The Oobleck VAE here downsamples 8 x 8 x 8 = 512 samples
into one latent, and the DiT's window is 64 latents: at most 64 x 512 / 16,000 = 2.048 s of
audio.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omni_runtime.models.components import save_pipeline, seeded, t5_tokenizer, tiny_t5_encoder

T5_ENCODER: dict[str, Any] = tiny_t5_encoder()
#: The width the projection model maps the text states and the seconds to (the DiT reads it).
CONDITIONING_DIM = 16
LATENT_CHANNELS = 8
VAE: dict[str, Any] = dict(
    encoder_hidden_size=8,
    downsampling_ratios=[8, 8, 8],
    channel_multiples=[1, 2, 2],
    decoder_channels=8,
    decoder_input_channels=LATENT_CHANNELS,
    audio_channels=2,
    sampling_rate=16_000,
)
TRANSFORMER: dict[str, Any] = dict(
    sample_size=64,
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    num_key_value_attention_heads=1,
    cross_attention_dim=16,
    time_proj_dim=16,
    # The start and end seconds, each projected to CONDITIONING_DIM, side by side.
    global_states_input_dim=2 * CONDITIONING_DIM,
    cross_attention_input_dim=CONDITIONING_DIM,
)
#: The seconds the projection model normalises (Stable Audio Open's own range).
PROJECTION: dict[str, Any] = dict(
    text_encoder_dim=T5_ENCODER["d_model"], conditioning_dim=CONDITIONING_DIM, min_value=0, max_value=512
)
#: Stable Audio Open's scheduler settings.
SCHEDULER: dict[str, Any] = dict(sigma_min=0.3, sigma_max=500, sigma_data=1.0, prediction_type="v_prediction")
#: Text tokens the pipeline pads prompts to (Stable Audio Open's is 128; the tiny one needs few).
MAX_SEQUENCE_LENGTH = 32
SEED = 0


def build_tiny_stable_audio(path: Path) -> None:
    """Write ``tiny-stable-audio`` (stereo, 16 kHz, up to 2.048 s) into the empty directory ``path``."""
    from diffusers import (
        AutoencoderOobleck,
        CosineDPMSolverMultistepScheduler,
        StableAudioDiTModel,
        StableAudioPipeline,
        StableAudioProjectionModel,
    )
    from transformers import T5Config, T5EncoderModel

    tokenizer = t5_tokenizer(model_max_length=MAX_SEQUENCE_LENGTH)
    config = T5Config(vocab_size=len(tokenizer), **T5_ENCODER)
    pipe = StableAudioPipeline(
        vae=seeded(SEED, lambda: AutoencoderOobleck(**VAE)),
        text_encoder=seeded(SEED, lambda: T5EncoderModel(config)),
        projection_model=seeded(SEED, lambda: StableAudioProjectionModel(**PROJECTION)),
        tokenizer=tokenizer,
        transformer=seeded(SEED, lambda: StableAudioDiTModel(**TRANSFORMER)),
        scheduler=CosineDPMSolverMultistepScheduler(**SCHEDULER),
    )
    save_pipeline(pipe, path)
