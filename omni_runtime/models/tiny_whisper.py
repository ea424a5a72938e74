"""``builtin:tiny-whisper``: a tiny random-weight Whisper speech-recognition model, built offline.

The model is a transformers ``WhisperForConditionalGeneration`` from a seeded config (about 0.2 M
parameters): 80 mel bins at 16 kHz, an encoder over a 10 s window (500 positions after its
stride-2 convolution; the real checkpoints' is 30 s), one encoder and one decoder layer. Its
processor is a ``WhisperFeatureExtractor`` (log-mel features over that window) and a
``WhisperTokenizer`` over the same byte-level BPE as ``tiny-lm`` plus Whisper's special tokens, so
every transcript decodes to text. All are written with ``save_pretrained`` and loaded back by the
``transcribe`` runner with ``from_pretrained``, as a real checkpoint is.

Random weights transcribe nothing a person said: the text is printable gibberish (the generation
config suppresses the bytes that are not printable ASCII, as tiny-lm's does), of a length bounded
by the request's ``max_transcript_tokens``.
"""

from __future__ import annotations

from pathlib import Path

from omni_runtime.models.tiny_lm import byte_bpe

#: Fixed seed of the weights: two builds write identical files.
SEED = 2468
SAMPLE_RATE = 16_000
#: Seconds of audio the encoder takes (its window).
WINDOW_S = 10
EOS_TOKEN = "<|endoftext|>"
START_TOKEN = "<|startoftranscript|>"
#: Whisper's task tokens, kept so the checkpoint has the layout a real one has.
SPECIAL_TOKENS = (START_TOKEN, "<|en|>", "<|transcribe|>", "<|notimestamps|>")
#: The tiny model's shape.
TINY = {"d_model": 32, "layers": 1, "heads": 2, "ffn": 64, "window_s": WINDOW_S}
#: Whisper-base's shape (about 72 M parameters, a 30 s window), for benchmarks of a recogniser
#: whose cost is a real one's (the weights are still random).
BASE = {"d_model": 512, "layers": 6, "heads": 8, "ffn": 2048, "window_s": 30}


def build_tiny_whisper(path: Path, shape: dict[str, int] = TINY) -> None:
    """Write the tiny Whisper model (config, weights, generation config) and its processor
    (feature extractor, tokenizer) into ``path``; ``shape`` (:data:`TINY`, :data:`BASE`) sets
    its width, depth and window."""
    import torch
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperTokenizer,
    )

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab, merges = byte_bpe()
    vocab[EOS_TOKEN] = len(vocab)
    tokenizer = WhisperTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tokenizer.save_pretrained(path)
    features = WhisperFeatureExtractor(
        feature_size=80, sampling_rate=SAMPLE_RATE, hop_length=160, chunk_length=shape["window_s"], n_fft=400
    )
    features.save_pretrained(path)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    start_id = tokenizer.convert_tokens_to_ids(START_TOKEN)
    config = WhisperConfig(
        vocab_size=len(tokenizer),
        num_mel_bins=80,
        d_model=shape["d_model"],
        encoder_layers=shape["layers"],
        decoder_layers=shape["layers"],
        encoder_attention_heads=shape["heads"],
        decoder_attention_heads=shape["heads"],
        encoder_ffn_dim=shape["ffn"],
        decoder_ffn_dim=shape["ffn"],
        max_source_positions=shape["window_s"] * SAMPLE_RATE // 160 // 2,
        max_target_positions=448,
        pad_token_id=eos_id,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        decoder_start_token_id=start_id,
        # Wider than the usual 0.02, so greedy decoding has clear winners (as tiny-lm's).
        init_std=0.2,
    )
    # Fork the RNG so that building does not move the caller's global torch seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = WhisperForConditionalGeneration(config).eval()
    # Byte tokens that are not printable ASCII, and the task tokens, are never generated.
    suppress = [b for b in range(256) if not 0x20 <= b <= 0x7E]
    suppress += [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    model.generation_config = GenerationConfig(
        decoder_start_token_id=start_id, eos_token_id=eos_id, pad_token_id=eos_id, suppress_tokens=suppress
    )
    model.save_pretrained(path)
