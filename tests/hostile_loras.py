"""Hostile LoRA adapter files built from a good tiny adapter, shared by the runner and engine tests."""

from __future__ import annotations

from pathlib import Path

import torch


def bin_adapter(adapter: Path, directory: Path) -> Path:
    """The adapter's own tensors in a torch pickle, as a folder holding only the ``.bin``."""
    from safetensors.torch import load_file

    directory.mkdir()
    torch.save(load_file(str(adapter / "pytorch_lora_weights.safetensors")), directory / "pytorch_lora_weights.bin")
    return directory


def nan_adapter(adapter: Path, directory: Path) -> Path:
    """The adapter with one weight set to NaN (its metadata kept, so it loads)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(adapter / "pytorch_lora_weights.safetensors"), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118 - not a dict
    first = sorted(tensors)[0]
    tensors[first] = tensors[first].clone()
    tensors[first][0, 0] = float("nan")
    directory.mkdir()
    save_file(tensors, str(directory / "pytorch_lora_weights.safetensors"), metadata=metadata)
    return directory
