"""``builtin:tiny-lm``: a tiny random-weight causal LM and its tokenizer, built offline.

The model is a Qwen2-style decoder (about 0.38 M parameters) from a seeded config; the tokenizer is a
byte-level BPE written by hand (the 256 byte symbols, a few dozen English merges, ``<|endoftext|>``
and ``<|pad|>``), so every string encodes and nothing is fetched. Both are written with
``save_pretrained`` and loaded back by the text runner with ``from_pretrained``, as a real model is.

Random weights would often pick bytes that are not printable ASCII (control bytes, halves of UTF-8
sequences) and decode to replacement characters. The builder lists those tokens in the generation
config's ``suppress_tokens``, which the runner masks, so generated text is gibberish but printable.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

#: Fixed seed of the weights: two builds write identical files.
SEED = 1234

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
#: Context length; RoPE has no table, so this is only the advertised limit.
MAX_POSITIONS = 16384

# Merges in priority order, each joining two existing symbols into a new one: first a space with
# each letter ("Ġ" is the byte-level symbol of a space), then these common English pairs.
_MERGE_PAIRS = (
    "t h, h e, i n, e r, a n, r e, o n, a t, e n, n d, e s, o r, t e, e d, i s, i t, a l, a r, "
    "s t, o u, n g, in g, Ġt he, Ġa nd, Ġo f, Ġi n, Ġt o, Ġi s, Ġa n, Ġa t"
)


def _byte_symbols() -> list[str]:
    """The 256 symbols a byte-level BPE uses for the bytes 0..255, in byte order.

    Printable Latin-1 bytes stand for themselves; the others are shifted past 255 so that every
    symbol is a visible character (the usual byte-level mapping).
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = 0
    symbols = []
    for b in range(256):
        if b in keep:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


def _tokenizer_vocab() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The vocab (byte ``b`` has id ``b``; merged symbols follow) and the merges."""
    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    merges = [("Ġ", c) for c in string.ascii_lowercase]
    merges += [(a, b) for a, b in (pair.split() for pair in _MERGE_PAIRS.split(", "))]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    return vocab, merges


def byte_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A fresh copy of the byte-level BPE's vocab and merges (tiny-whisper's tokenizer is built on it)."""
    return _tokenizer_vocab()


def build_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Write the byte-level BPE tokenizer to ``path`` and return it."""
    from transformers import Qwen2Tokenizer

    vocab, merges = _tokenizer_vocab()
    # The Qwen2 class, because AutoTokenizer loads that class for a qwen2 model whatever the files
    # say; building with it means the tokenizer written is exactly the tokenizer loaded.
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,  # byte-level: every string encodes, nothing is unknown
        bos_token=None,
        padding_side="left",  # batched generation pads on the left
        clean_up_tokenization_spaces=False,  # keeps incremental decoding prefix-stable
        model_max_length=MAX_POSITIONS,
    )
    tokenizer.save_pretrained(path)
    return tokenizer


def build_tiny_lm(path: Path) -> None:
    """Write the tiny LM (config, weights, generation config, tokenizer) into ``path``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    tokenizer = build_tokenizer(path)
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        # Wider than the usual 0.02, so logits are spread out: greedy decoding then has clear
        # winners, and batched and solo runs pick the same token despite float round-off.
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    # Fork the RNG so that building does not move the caller's global torch seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = Qwen2ForCausalLM(config).eval()
    # Byte tokens that are not printable ASCII, and padding, are never generated.
    suppress = [b for b in range(256) if not 0x20 <= b <= 0x7E] + [pad_id]
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, suppress_tokens=suppress)
    model.save_pretrained(path)
