"""Pieces the tiny-model builders share: seeded construction, offline tokenizers, byte-stable saving.

Every builtin is made from configs with random weights and hand-written vocabularies, so nothing
is downloaded and two builds write identical bytes. The tokenizers are real ``tokenizers`` models
(BPE or Unigram) wrapped in the transformers class each pipeline expects, so a reload with
``from_pretrained`` gives back exactly the tokenizer that was saved.
"""

from __future__ import annotations

import json
import string
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from transformers import CLIPTokenizer, GemmaTokenizer, T5Tokenizer

T = TypeVar("T")

#: Words given their own token in the T5 and Gemma vocabularies, so that a prompt is a handful of
#: tokens rather than one per character (anything else is spelled out). The last line is words of
#: the instruction of about 1,000 characters that Sana puts before every prompt.
WORDS = (
    "a an the of and in on with at to is are for from by",
    "cat dog fox bird horse cup coffee tea river tree forest city street sky sun moon",
    "mountain sea house car toy dinosaur painting photo image portrait red green blue",
    "white black small big running sleeping yawning eating burger squirrel",
    "prompt user enhanced generate detailed visual description descriptions colors shapes",
)
#: The merges of the CLIP BPE of the builtins (``tiny-sd``'s and the other CLIP text encoders'): a
#: few common English pairs, enough for the BPE model to be a real one; ids 512..519.
MERGES = ("t h", "i n", "e r", "o n", "a n", "r e", "th e</w>", "in g</w>")
#: Its entries: 256 byte characters, the same with ``</w>``, the merges, start and end of text.
CLIP_VOCAB_SIZE = 522
#: Tokenizer-side keys that record how a tokenizer was loaded rather than what it is; transformers 5
#: writes them into ``tokenizer_config.json``, which would make two builds' files differ by path.
LOAD_TIME_KEYS = ("local_files_only", "is_local", "name_or_path", "_commit_hash")


def seeded(seed: int, make: Callable[[], T]) -> T:
    """``make()`` under its own seed, leaving the caller's global random state as it was.

    Each component is seeded on its own, so a change to one leaves the others' weights alone.
    """
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def _byte_alphabet() -> list[str]:
    """The 256 printable characters GPT-2/CLIP byte-level BPE maps the bytes 0..255 to."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def write_clip_vocab(directory: Path) -> None:
    """Write the 522-entry CLIP ``vocab.json`` and ``merges.txt`` (ids match ``tiny-sd``'s
    ``TEXT_ENCODER``, in omni_runtime/models/families/sd/tiny.py)."""
    alphabet = _byte_alphabet()
    tokens = alphabet + [c + "</w>" for c in alphabet] + [m.replace(" ", "") for m in MERGES]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    assert len(tokens) == CLIP_VOCAB_SIZE
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(MERGES) + "\n")


def clip_tokenizer() -> CLIPTokenizer:
    """The 522-entry CLIP BPE of ``tiny-sd`` (ids match ``tiny_sd.TEXT_ENCODER``)."""
    from transformers import CLIPTokenizer

    with tempfile.TemporaryDirectory() as vocab_dir:
        write_clip_vocab(Path(vocab_dir))
        return CLIPTokenizer.from_pretrained(vocab_dir, model_max_length=77, local_files_only=True)


def _word_list() -> list[str]:
    return [word for line in WORDS for word in line.split()]


def t5_tokenizer(model_max_length: int = 512) -> T5Tokenizer:
    """A Unigram tokenizer in T5's layout: ``<pad>`` 0, ``</s>`` 1, ``<unk>`` 2, then pieces.

    Pieces are printable ASCII characters (alone and after the ``▁`` word marker) and whole common
    words; a whole word scores higher than its spelling, so Unigram picks it.
    """
    from transformers import T5Tokenizer

    chars = [c for c in string.printable if not c.isspace()]
    vocab: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -5.0) for c in chars]
    vocab += [("▁" + c, -5.0) for c in chars]
    seen = {piece for piece, _ in vocab}
    vocab += [("▁" + w, -3.0) for w in _word_list() if "▁" + w not in seen]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)


def gemma_tokenizer(model_max_length: int = 8192) -> GemmaTokenizer:
    """A byte-fallback BPE in Gemma's layout: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3.

    The 256 ``<0xNN>`` byte tokens make every string encodable; printable ASCII characters and
    ``▁`` (Gemma's space) are single tokens, and each common word is built up by merges, one
    character at a time (``▁t`` + ``h`` -> ``▁th`` ...), so BPE ends on the whole word.
    """
    from transformers import GemmaTokenizer

    vocab: dict[str, int] = {}
    for token in ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>"):
        vocab[token] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in ["▁", *(c for c in string.printable if not c.isspace())]:
        vocab.setdefault(c, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in _word_list():
        piece = "▁" + word[0]
        if piece not in vocab:
            merges.append(("▁", word[0]))
            vocab[piece] = len(vocab)
        for c in word[1:]:
            if piece + c not in vocab:
                merges.append((piece, c))
                vocab[piece + c] = len(vocab)
            piece += c
    # add_bos_token: Gemma's own tokenizer starts every sequence with <bos>; Sana keeps that position.
    return GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, model_max_length=model_max_length)


def tiny_t5_encoder(d_model: int = 32, d_ff: int = 37) -> dict[str, Any]:
    """The config of the builtins' tiny T5 encoder (PixArt, SD3, Flux; Wan's UMT5 takes the same
    keys): 2 layers of 4 heads x 8, gated GELU, encoder only. ``d_model`` is the width the
    denoiser's text projection reads."""
    return dict(
        d_model=d_model,
        d_kv=8,
        d_ff=d_ff,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=0,
        eos_token_id=1,
    )


def save_pipeline(pipe: Any, path: Path, clip_tokenizers: tuple[str, ...] = ()) -> None:
    """``save_pretrained`` with safetensors, then strip load-time keys from every tokenizer folder.

    ``clip_tokenizers`` names the folders holding a CLIP tokenizer: they also get ``vocab.json`` and
    ``merges.txt`` back (transformers 5 writes only ``tokenizer.json``), as ``tiny-sd``'s has.
    """
    from transformers.utils import logging as transformers_logging

    path = Path(path)
    # The shard-writing progress bar is noise for a few-MB model written at first use.
    bars_were_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        pipe.save_pretrained(path, safe_serialization=True)
    finally:
        if bars_were_on:
            transformers_logging.enable_progress_bar()
    for config_file in sorted(path.glob("tokenizer*/tokenizer_config.json")):
        config = json.loads(config_file.read_text())
        for key in LOAD_TIME_KEYS:
            config.pop(key, None)
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for folder in clip_tokenizers:
        write_clip_vocab(path / folder)
