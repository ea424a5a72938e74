"""The builtin tiny Stable Diffusion builders: seeded, offline, loadable like a real model."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from omni_runtime.models.builtin import CACHE_VERSION
from omni_runtime.models.families.sd.tiny import TEXT_ENCODER, build_tiny_sd, write_clip_vocab


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_clip_vocab_matches_the_text_encoder(tmp_path: Path) -> None:
    write_clip_vocab(tmp_path)
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    assert len(vocab) == TEXT_ENCODER["vocab_size"]
    assert sorted(vocab.values()) == list(range(TEXT_ENCODER["vocab_size"]))
    assert vocab["<|startoftext|>"] == TEXT_ENCODER["bos_token_id"]
    assert vocab["<|endoftext|>"] == TEXT_ENCODER["eos_token_id"]
    merges = (tmp_path / "merges.txt").read_text().splitlines()
    assert merges[0] == "#version: 0.2"
    assert all(a + b in vocab for a, b in (m.split() for m in merges[1:]))


def test_two_builds_are_identical(tmp_path: Path) -> None:
    build_tiny_sd(tmp_path / "a")
    build_tiny_sd(tmp_path / "b")
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a.keys() == b.keys()
    assert {"model_index.json", "unet/diffusion_pytorch_model.safetensors", "tokenizer/vocab.json"} <= a.keys()
    assert a == b
    tokenizer_config = json.loads(a["tokenizer/tokenizer_config.json"])
    assert "local_files_only" not in tokenizer_config


def test_loads_offline_and_makes_a_small_image(tmp_path: Path) -> None:
    import torch
    from diffusers import DiffusionPipeline

    build_tiny_sd(tmp_path)
    pipe = DiffusionPipeline.from_pretrained(tmp_path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.tokenizer("the running cat").input_ids[0] == TEXT_ENCODER["bos_token_id"]

    def generate():
        return pipe(
            "a cup",
            height=64,
            width=64,
            num_inference_steps=4,
            output_type="np",
            generator=torch.Generator().manual_seed(0),
        ).images

    # Deterministic for a seed, and tiny: about 2.1 million parameters in all (what keeps the suite's
    # model loads and forwards cheap; its speed is measured in benchmarks/, not asserted here).
    first = generate()
    assert first.shape == (1, 64, 64, 3)
    assert (generate() == first).all()
    assert sum(p.numel() for m in (pipe.unet, pipe.vae, pipe.text_encoder) for p in m.parameters()) < 3_000_000


def _ensure_in_child(barrier, results) -> None:
    """Spawned child: build (or wait for) tiny-sd, then load it with the hub switched off."""
    import huggingface_hub.constants
    from diffusers import DiffusionPipeline

    from omni_runtime.models.builtin import ensure_builtin

    assert huggingface_hub.constants.HF_HUB_OFFLINE
    barrier.wait(timeout=120)
    path = ensure_builtin("tiny-sd")
    pipe = DiffusionPipeline.from_pretrained(path)
    results.put((str(path), type(pipe).__name__, pipe.unet.config.sample_size))


def test_ensure_builtin_from_two_processes_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Spawned children inherit the environment: a private cache, and the hub switched off.
    monkeypatch.setenv("OMNI_RUNTIME_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_ensure_in_child, args=(barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    target = tmp_path / f"tiny-sd-{CACHE_VERSION}"
    assert outcomes == [(str(target), "StableDiffusionPipeline", 32)] * 2
    # One published build and no half-written leftovers.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [target.name]
    assert (target / "model_index.json").is_file()
