"""A tiny random LoRA adapter for the builtin ``tiny-sd`` / ``small-sd``, built offline.

The adapter is made the way a trained one is saved: peft LoRA layers are added to a UNet and a CLIP
text encoder of the builtin model's architecture (built from the same configs), their A and B
matrices are filled with seeded random values (a fresh adapter's B is zero and would change
nothing), and diffusers' ``save_lora_weights`` writes ``pytorch_lora_weights.safetensors``. It is
loaded back like any adapter, with ``pipe.load_lora_weights(directory)``; two builds with one seed
hold identical tensors and metadata, and different seeds give different adapters.

From a shell: ``python -m omni_runtime.models.tiny_lora DIRECTORY [--seed N] [--model small-sd]``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal

from omni_runtime.models.families.sd.tiny import SMALL_UNET, TEXT_ENCODER, TINY_UNET

#: The attention projections an SD LoRA usually adapts.
UNET_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
TEXT_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")


def build_tiny_sd_lora(
    path: str | Path,
    *,
    seed: int = 0,
    model: Literal["tiny-sd", "small-sd"] = "tiny-sd",
    rank: int = 4,
    std: float = 0.1,
    text_encoder: bool = True,
) -> Path:
    """Write a LoRA adapter for ``model`` into the directory ``path`` (created if need be).

    ``std`` is the spread of the A and B entries; with ``lora_alpha == rank`` the update of a
    weight is ``scale * B @ A``. ``text_encoder=False`` adapts the UNet alone.
    """
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    from transformers import CLIPTextConfig, CLIPTextModel

    unet_config = {"tiny-sd": TINY_UNET, "small-sd": SMALL_UNET}[model]
    path = Path(path)
    layers: dict[str, Any] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # diffusers / transformers models: add_adapter and peft_config come from their PEFT mixins.
        parts: list[tuple[str, Any, tuple[str, ...]]] = [("unet", UNet2DConditionModel(**unet_config), UNET_TARGETS)]
        if text_encoder:
            parts.append(("text_encoder", CLIPTextModel(CLIPTextConfig(**TEXT_ENCODER)), TEXT_TARGETS))
        generator = torch.Generator().manual_seed(seed)
        for component, module, targets in parts:
            module.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets)))
            state = get_peft_model_state_dict(module)
            # Sorted: the values do not depend on the order the modules happen to be listed in.
            for name in sorted(state):
                state[name] = torch.randn(state[name].shape, generator=generator) * std
            layers[f"{component}_lora_layers"] = convert_state_dict_to_diffusers(state)
            # The adapter's config (rank, alpha, targets) travels with it, as training scripts save it.
            metadata = module.peft_config["default"].to_dict()
            metadata["target_modules"] = sorted(metadata["target_modules"])  # a set: in no fixed order
            layers[f"{component}_lora_adapter_metadata"] = metadata
    StableDiffusionPipeline.save_lora_weights(path, safe_serialization=True, **layers)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m omni_runtime.models.tiny_lora",
        description="Write a random LoRA adapter for the builtin tiny-sd (or small-sd) into DIRECTORY.",
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0, help="seed of the adapter's values (default: 0)")
    parser.add_argument("--model", choices=["tiny-sd", "small-sd"], default="tiny-sd", help="the base model")
    parser.add_argument("--unet-only", action="store_true", help="no text-encoder layers")
    args = parser.parse_args(argv)
    out = build_tiny_sd_lora(args.directory, seed=args.seed, model=args.model, text_encoder=not args.unet_only)
    print(out.resolve())


if __name__ == "__main__":
    main()
