"""The ``builtin:tiny-lm`` builder: deterministic, offline, and every string tokenizes."""

from __future__ import annotations

import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from omni_runtime.models.builtin import resolve_model
from omni_runtime.models.tiny_lm import _byte_symbols, _tokenizer_vocab, build_tiny_lm

PROMPTS = [
    "hello the world and of",
    "",
    " leading and trailing spaces ",
    "naïve café déjà vu",
    "日本語のテキスト",
    "emoji 🐍🚀👩‍💻 and flags 🇫🇷",
    "مرحبا بالعالم",
    "e\u0301 combining, NFD",
    "tabs\tnew\nlines\r\n and \x00\x07 control bytes",
    "math ∑∫√∞ ≠ ≤",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMNI_RUNTIME_CACHE", str(tmp_path_factory.mktemp("cache")))
        return Path(resolve_model("builtin:tiny-lm"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_byte_symbols_are_distinct_and_visible() -> None:
    symbols = _byte_symbols()
    assert len(set(symbols)) == 256
    assert all(s.isprintable() and not s.isspace() for s in symbols)


def test_every_merge_joins_known_symbols() -> None:
    vocab, merges = _tokenizer_vocab()
    for a, b in merges:
        assert a in vocab and b in vocab and a + b in vocab
    assert sorted(vocab.values()) == list(range(len(vocab)))


def test_two_builds_are_identical(tmp_path: Path) -> None:
    build_tiny_lm(tmp_path / "a")
    build_tiny_lm(tmp_path / "b")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(names)
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_reloads_offline_in_a_fresh_process(model_dir: Path) -> None:
    # A fresh interpreter, so the hub's offline switch is read at import as a user would set it.
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "ids = tok('the cat', return_tensors='pt')['input_ids']\n"
        "print(model(ids).logits.shape[-1], len(tok), model.num_parameters())\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    vocab_out, vocab_tok, params = map(int, done.stdout.split()[-3:])
    assert vocab_out == vocab_tok
    assert 100_000 < params < 1_000_000


@pytest.mark.parametrize("text", PROMPTS)
def test_any_text_tokenizes_and_round_trips(tokenizer, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert bool(ids) == bool(text)
    assert all(0 <= i < len(tokenizer) for i in ids)
    # The Qwen2 tokenizer normalises to NFC; apart from that, byte-level BPE loses nothing.
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_tokens_left_unsuppressed_decode_to_printable_text(model_dir: Path, tokenizer) -> None:
    from transformers import GenerationConfig

    gen = GenerationConfig.from_pretrained(model_dir)
    allowed = set(range(len(tokenizer))) - set(gen.suppress_tokens) - {gen.eos_token_id}
    assert len(allowed) > 100
    for token in allowed:
        text = tokenizer.decode([token])
        assert text and text.isprintable() and text.isascii(), (token, text)
