"""``builtin:tiny-tts``: a tiny random-weight VITS text-to-speech model and its tokenizer, built offline.

The model is a transformers ``VitsModel`` from a seeded config (about 0.2 M parameters): mono 16 kHz
audio, 256 samples per spectrogram frame, four speakers. The tokenizer is a ``VitsTokenizer`` over a
character vocabulary written here (lower-case letters, digits, a few punctuation marks, space):
text is lower-cased and every character outside the vocabulary is dropped, as the MMS models do.
Both are written with ``save_pretrained`` and loaded back by the speech runner with
``from_pretrained``, as a real checkpoint is.

Random weights would give each character a duration near one frame, so that ``speed`` could not
make a clip shorter (a duration is rounded up to whole frames). The builder sets the duration
predictor's output to about :data:`FRAMES_PER_TOKEN` frames, so a clip's length follows the text
and the speaking rate the way a trained model's does.
"""

from __future__ import annotations

import json
import math
import string
from pathlib import Path

#: Fixed seed of the weights: two builds write identical files.
SEED = 4321
SAMPLE_RATE = 16_000
#: The speakers, by name (``voice``) -> speaker id; the first is the default.
SPEAKERS: dict[str, int] = {"ada": 0, "ben": 1, "cleo": 2, "dev": 3}
#: About how many spectrogram frames (256 samples each) a token lasts at speed 1.
FRAMES_PER_TOKEN = 6.0
PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"


def vocab() -> dict[str, int]:
    """The character vocabulary: padding (which is also the blank VITS puts between characters),
    then space, letters, digits and a few punctuation marks."""
    chars = [PAD_TOKEN, " ", *string.ascii_lowercase, *string.digits, *"'.,!?-", UNK_TOKEN]
    return {c: i for i, c in enumerate(chars)}


def build_tiny_tts(path: Path) -> None:
    """Write the tiny VITS model (config, weights) and its tokenizer into ``path``."""
    import torch
    from transformers import VitsConfig, VitsModel, VitsTokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "vocab.json").write_text(json.dumps(vocab(), ensure_ascii=False))
    tokenizer = VitsTokenizer(
        vocab_file=str(path / "vocab.json"),
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        add_blank=True,
        normalize=True,
        phonemize=False,  # characters, not phonemes: nothing outside Python is needed
        is_uroman=False,
    )
    tokenizer.save_pretrained(path)
    config = VitsConfig(
        vocab_size=len(vocab()),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        window_size=4,
        ffn_dim=64,
        ffn_kernel_size=3,
        flow_size=32,
        spectrogram_bins=33,
        upsample_initial_channel=32,
        upsample_rates=[8, 8, 2, 2],
        upsample_kernel_sizes=[16, 16, 4, 4],
        resblock_kernel_sizes=[3],
        resblock_dilation_sizes=[[1, 3]],
        use_stochastic_duration_prediction=False,
        duration_predictor_filter_channels=32,
        prior_encoder_num_flows=2,
        prior_encoder_num_wavenet_layers=2,
        posterior_encoder_num_wavenet_layers=2,
        num_speakers=len(SPEAKERS),
        speaker_embedding_size=16,
        sampling_rate=SAMPLE_RATE,
        pad_token_id=vocab()[PAD_TOKEN],
    )
    # The speakers by name, read by the speech runner (a checkpoint without them has speaker ids).
    config.speakers = dict(SPEAKERS)
    # Fork the RNG so that building does not move the caller's global torch seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = VitsModel(config).eval()
        with torch.no_grad():
            proj = model.duration_predictor.proj
            proj.weight.mul_(0.05)  # durations vary a little with the text and the speaker...
            proj.bias.fill_(math.log(FRAMES_PER_TOKEN))  # ...around this many frames
    model.save_pretrained(path)
