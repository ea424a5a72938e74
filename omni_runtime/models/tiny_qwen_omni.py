"""``builtin:tiny-qwen-omni``: a tiny random-weight Qwen2.5-Omni (thinker, talker, token2wav), built offline.

Three transformers models from seeded configs, each written with ``save_pretrained`` into its own
sub-directory and loaded back by its stage with ``from_pretrained``, as a real checkpoint's parts are:

- ``thinker/``: ``Qwen2_5OmniThinkerForConditionalGeneration`` (a 2-layer text model, about 0.15 M
  parameters) and the byte-level tokenizer of ``builtin:tiny-lm``. The config demands an audio and
  a vision tower: both are one layer of width 16 and are never run (the stages take text only).
- ``talker/``: ``Qwen2_5OmniTalkerForConditionalGeneration`` (2 layers): thinker states in, codec
  codes out. Codes ``0 .. CODEBOOK_SIZE - 1`` are sounds; the codec's special tokens follow.
- ``token2wav/``: ``Qwen2_5OmniToken2WavModel``: a 2-layer DiT (codes -> mel spectrogram, solved
  as an ODE from noise in a few steps) and a small BigVGAN (mel -> 16 kHz waveform, 32 samples per
  mel frame, two mel frames per code). Each voice's conditioning (a speaker vector and a reference
  mel) is in ``speakers.safetensors``, as the real model's ``spk_dict.pt`` holds them.

The thinker's vocabulary is the tokenizer's plus :data:`RESERVED` ids past it (the multimodal
placeholders and the talker's text markers), which the tokenizer never produces and generation
suppresses, along with the bytes that are not printable ASCII.
"""

from __future__ import annotations

from pathlib import Path

from omni_runtime.models.tiny_lm import build_tokenizer

#: Fixed seed of the weights: two builds write identical files.
SEED = 2525
SAMPLE_RATE = 16_000
#: Codes a talker emits that are sounds; its special tokens come after them.
CODEBOOK_SIZE = 64
#: The voices (token2wav conditioning), by name -> index; the first is the default.
SPEAKERS: dict[str, int] = {"chelsie": 0, "ethan": 1}
#: Names of the ids past the tokenizer's vocabulary, in order.
RESERVED = (
    "audio",
    "image",
    "video",
    "audio_start",
    "audio_end",
    "vision_start",
    "vision_end",
    "user",
    "tts_text_start",
    "tts_text_end",
    "tts_text_pad",
)
#: The codec's special tokens, right after the codebook.
CODEC_SPECIAL = ("pad", "start", "end", "mask")
HIDDEN = 64
MEL_DIM = 16
#: Reference-mel frames of each voice.
REF_MEL_FRAMES = 24
#: About how loud (RMS) a clip of the tiny decoder is.
TARGET_RMS = 0.1
#: The DiT's longest mel (frames); a request's codes x 2 must fit.
MAX_MEL_FRAMES = 4096


def reserved_ids(vocab: int) -> dict[str, int]:
    """The reserved ids of a thinker whose tokenizer has ``vocab`` entries."""
    return {name: vocab + i for i, name in enumerate(RESERVED)}


def codec_ids() -> dict[str, int]:
    return {name: CODEBOOK_SIZE + i for i, name in enumerate(CODEC_SPECIAL)}


def _mrope() -> dict[str, object]:
    # Multimodal RoPE over 16-wide heads: 8 frequency pairs split time/height/width.
    return {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}


def _build_thinker(path: Path) -> dict[str, int]:
    import torch
    from transformers import GenerationConfig, Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

    tokenizer = build_tokenizer(path)
    base = len(tokenizer)
    ids = reserved_ids(base)
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = Qwen2_5OmniThinkerConfig(
        text_config={
            "vocab_size": base + len(RESERVED),
            "hidden_size": HIDDEN,
            "intermediate_size": 2 * HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_parameters": _mrope(),
            "max_position_embeddings": 8192,
            # Spread-out logits, as tiny-lm's: greedy picks have clear winners.
            "initializer_range": 0.2,
            "tie_word_embeddings": False,
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
        },
        audio_config={
            "d_model": 16,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "num_mel_bins": 16,
            "output_dim": HIDDEN,
            "n_window": 10,
            "max_source_positions": 100,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": HIDDEN,
            "fullatt_block_indexes": [0],
        },
        audio_token_index=ids["audio"],
        image_token_index=ids["image"],
        video_token_index=ids["video"],
        audio_start_token_id=ids["audio_start"],
        audio_end_token_id=ids["audio_end"],
        user_token_id=ids["user"],
        initializer_range=0.2,
    )
    # Read by the model's position code, though the config class does not declare it.
    config.vision_start_token_id = ids["vision_start"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen2_5OmniThinkerForConditionalGeneration(config).eval()
    suppress = [b for b in range(256) if not 0x20 <= b <= 0x7E] + [pad_id, *ids.values()]
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, suppress_tokens=suppress)
    model.save_pretrained(path)
    return ids


def _build_talker(path: Path, ids: dict[str, int]) -> None:
    import torch
    from transformers import Qwen2_5OmniTalkerConfig, Qwen2_5OmniTalkerForConditionalGeneration

    codec = codec_ids()
    config = Qwen2_5OmniTalkerConfig(
        vocab_size=CODEBOOK_SIZE + len(CODEC_SPECIAL),
        tts_codec_start_token_id=codec["start"],
        tts_codec_end_token_id=codec["end"],
        tts_codec_pad_token_id=codec["pad"],
        tts_codec_mask_token_id=codec["mask"],
        tts_text_start_token_id=ids["tts_text_start"],
        tts_text_end_token_id=ids["tts_text_end"],
        tts_text_pad_token_id=ids["tts_text_pad"],
        audio_token_index=ids["audio"],
        image_token_index=ids["image"],
        video_token_index=ids["video"],
        audio_start_token_id=ids["audio_start"],
        audio_end_token_id=ids["audio_end"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        embedding_size=HIDDEN,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters=_mrope(),
        max_position_embeddings=8192,
        initializer_range=0.2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + 1)
        model = Qwen2_5OmniTalkerForConditionalGeneration(config).eval()
        # A random talker picks its end token as often as any code and would often stop after a
        # few: the end's logit is held at zero (the codes' spread about +-1.6), so a clip usually
        # runs to max_codes and sometimes ends before it, as a trained talker's does.
        with torch.no_grad():
            model.codec_head.weight[codec["end"]].zero_()
    model.save_pretrained(path)


def _build_token2wav(path: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2_5OmniToken2WavConfig, Qwen2_5OmniToken2WavModel

    speaker_dim = 8
    config = Qwen2_5OmniToken2WavConfig(
        dit_config={
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "head_dim": 16,
            "emb_dim": 16,
            "num_embeds": CODEBOOK_SIZE + 1,
            "mel_dim": MEL_DIM,
            "enc_emb_dim": speaker_dim,
            "enc_dim": 8,
            "enc_channels": [16, 16, 16, 16, 48],
            "enc_attention_channels": 8,
            "enc_se_channels": 8,
            "block_size": 8,
            "look_ahead_layers": [1],
            "look_backward_layers": [0],
            "max_position_embeddings": MAX_MEL_FRAMES,
            "dropout": 0.0,
        },
        bigvgan_config={
            "mel_dim": MEL_DIM,
            "upsample_initial_channel": 32,
            "resblock_kernel_sizes": [3],
            "resblock_dilation_sizes": [[1, 3, 5]],
            "upsample_rates": [4, 4, 2],
            "upsample_kernel_sizes": [8, 8, 4],
        },
    )
    # The voices, read by the code2wav stage (the model's config has no place for them).
    config.speakers = dict(SPEAKERS)
    config.num_speakers = len(SPEAKERS)
    config.sampling_rate = SAMPLE_RATE
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED + 2)
        model = Qwen2_5OmniToken2WavModel(config).eval().float()
        voices = {}
        for name in SPEAKERS:
            voices[f"{name}.cond"] = torch.randn(speaker_dim)
            voices[f"{name}.ref_mel"] = torch.randn(REF_MEL_FRAMES, MEL_DIM)
        # Random BigVGAN weights make a near-silent wave (RMS ~1e-6): its last convolution is
        # scaled so that a typical clip has an RMS of about TARGET_RMS, audible and unclipped.
        with torch.no_grad():
            codes = (torch.arange(32) * 7 % CODEBOOK_SIZE).unsqueeze(0)
            first = next(iter(SPEAKERS))
            mel = model.code2wav_dit_model.sample(
                voices[f"{first}.cond"].unsqueeze(0), voices[f"{first}.ref_mel"].unsqueeze(0), codes, num_steps=4
            )
            # Far below the vocoder's clamp to [-1, 1], so the output is linear in its last conv.
            scale = TARGET_RMS / float(model.code2wav_bigvgan_model(mel).std())
            conv = model.code2wav_bigvgan_model.conv_post
            conv.weight.mul_(scale)
            if conv.bias is not None:
                conv.bias.mul_(scale)
    model.save_pretrained(path)
    save_file(voices, str(path / "speakers.safetensors"))


def build_tiny_qwen_omni(path: Path) -> None:
    """Write the thinker, talker and token2wav into ``path/thinker``, ``path/talker``, ``path/token2wav``."""
    path = Path(path)
    for part in ("thinker", "talker", "token2wav"):
        (path / part).mkdir(parents=True, exist_ok=True)
    ids = _build_thinker(path / "thinker")
    _build_talker(path / "talker", ids)
    _build_token2wav(path / "token2wav")
