"""The prompt-embedding cache of step execution (``engine_args.prompt_cache``): what a family's
``encode`` made for a request, kept by everything that encode may read, so a prompt seen again is
not run through the text encoders again.

The diffusion stepper asks it before each batched encode (:meth:`PromptEmbeddingCache.plan`):
requests whose key is stored get the stored tensors; of the rest, one request per key is encoded
(a prompt asked for twice in one admission is encoded once) and stored afterwards
(:meth:`PromptEmbeddingCache.remember`). The key holds the prompt, the negative prompt, the guidance
mode and scale (Flux's guidance is an encoder output), the rows, the size (SDXL's time ids), the
frames and the LoRA adapter with its scale (an adapter may patch a text encoder); an img2img
request's input image too, unless its family says its encode never reads it
(:attr:`~omni_runtime.stage.runners.diffusion_steps.StepFamily.encode_reads_image`).

Stored tensors are shared, never copied: the step loop only reads a request's ``cond`` /
``uncond`` / ``shared`` tensors (every denoiser call concatenates them into a new batch), and a
hit gets dicts of its own, so a family writing into its state's dicts (Flux's ``img_ids``) does
not reach the cache. The cache lives on the stage's device and is cleared with everything its
entries were made from: the model (sleep, wake-up, load) and the LoRA set (``add_lora``,
``remove_lora``).

Runs in the stage worker's forward thread, like every encode and every control call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omni_runtime.stage.byte_cache import ByteLRU
from omni_runtime.stage.runners.diffusion_steps import StepState
from omni_runtime.stage.runners.lora import LoraAdapters


@dataclass(frozen=True)
class EncodedPrompt:
    """What one request's encode left in its state, as stored."""

    cond: dict[str, torch.Tensor]
    uncond: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor]


@dataclass
class EncodePlan:
    """The requests of one encoder call, as the cache sorted them."""

    #: To encode: one request per key not stored (and every request that has no key).
    encode: list[StepState]
    #: A request whose prompt another request of ``encode`` has: filled from it once encoded.
    followers: list[tuple[StepState, StepState]]


class PromptEmbeddingCache:
    """The encoder outputs of one replica's model, bounded by bytes, least recently used out first."""

    def __init__(self, max_bytes: int) -> None:
        self.store: ByteLRU[Hashable, EncodedPrompt] = ByteLRU(max_bytes)

    def key(self, state: StepState, reads_image: bool) -> Hashable | None:
        """Everything ``encode`` may read of ``state``; None: it is not cached (a prompt that is
        not text, an input image the encode may read and that cannot be hashed)."""
        if not isinstance(state.prompt, str):
            return None
        image = None
        if state.image is not None and reads_image:
            image = image_digest(state.image)
            if image is None:
                return None
        return (
            state.prompt,
            state.negative_prompt,
            state.cfg,
            float(state.guidance),
            state.rows,
            state.height,
            state.width,
            state.num_frames,
            LoraAdapters.key(state.lora),
            image,
        )

    def plan(self, states: list[StepState], reads_image: bool) -> EncodePlan:
        """Fill the states whose key is stored (hits), and say which of the others to encode."""
        plan = EncodePlan(encode=[], followers=[])
        leaders: dict[Hashable, StepState] = {}
        for s in states:
            key = self.key(s, reads_image)
            s.prompt_key = key
            if key is None:
                plan.encode.append(s)
                continue
            leader = leaders.get(key)
            if leader is not None:
                # Encoded once for both; counted as a hit, which it is for the encoder.
                self.store.hits += 1
                s.prompt_cache_hit = True
                plan.followers.append((s, leader))
                continue
            found = self.store.get(key)
            if found is not None:
                s.prompt_cache_hit = True
                fill(s, found)
                continue
            s.prompt_cache_hit = False
            leaders[key] = s
            plan.encode.append(s)
        return plan

    def remember(self, states: list[StepState]) -> None:
        """Store what ``encode`` just made for ``states`` (those with a key)."""
        for s in states:
            if s.prompt_key is None:
                continue
            entry, nbytes = stored(s)
            evicted = self.store.put(s.prompt_key, entry, nbytes + key_bytes(s.prompt_key))
            s.prompt_cache_evictions = evicted or 0

    def follow(self, follower: StepState, leader: StepState) -> None:
        """``follower`` gets what was just encoded for ``leader`` (the same key)."""
        fill(follower, EncodedPrompt(leader.cond, leader.uncond, leader.shared))

    def invalidate(self) -> None:
        """The model or its adapters changed: nothing stored was made by the model there is now."""
        self.store.clear()

    def metrics(self, state: StepState) -> dict[str, int]:
        """A finished request's output metrics (``/metrics`` counts them): whether its prompt was a
        hit, the entries its own encode evicted, and the cache's size now."""
        if state.prompt_cache_hit is None:
            return {}
        out = {
            "prompt_cache_hit": int(state.prompt_cache_hit),
            "prompt_cache_bytes": self.store.bytes,
            "prompt_cache_entries": len(self.store),
        }
        if state.prompt_cache_evictions:
            out["prompt_cache_evictions"] = state.prompt_cache_evictions
        return out

    def stats(self) -> dict[str, Any]:
        return self.store.stats()


def fill(state: StepState, entry: EncodedPrompt) -> None:
    """``state``'s encoder outputs from ``entry``: the tensors shared, the dicts its own."""
    state.cond = dict(entry.cond)
    state.uncond = dict(entry.uncond)
    state.shared = dict(entry.shared)


def stored(state: StepState) -> tuple[EncodedPrompt, int]:
    """What to store of an encoded state, and its bytes: each tensor's own storage (a view into a
    larger batch is copied out, so the entry holds only what it counts), a storage shared by two
    of its tensors counted once (SDXL's time ids are in both halves)."""
    seen: dict[int, int] = {}

    def own(t: torch.Tensor) -> torch.Tensor:
        size = t.numel() * t.element_size()
        if t.untyped_storage().nbytes() > size:
            t = t.clone(memory_format=torch.contiguous_format)
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    entry = EncodedPrompt(
        cond={k: own(v) for k, v in state.cond.items()},
        uncond={k: own(v) for k, v in state.uncond.items()},
        shared={k: own(v) for k, v in state.shared.items()},
    )
    return entry, sum(seen.values())


def key_bytes(key: Hashable) -> int:
    """The bytes of a key's text, kept with its entry: a prompt may be 100,000 characters, far
    more than a small model's embeddings, so it counts toward the bound too."""
    parts = key if isinstance(key, tuple) else (key,)
    return sum(len(part.encode("utf-8", "surrogatepass")) for part in parts if isinstance(part, str))


def image_digest(image: Any) -> bytes | None:
    """A digest of an input image's pixels, shape and dtype (None: not an array)."""
    if not isinstance(image, np.ndarray) or image.dtype.hasobject:
        return None
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.dtype.str}{image.shape}".encode())
    h.update(np.ascontiguousarray(image).data)
    return h.digest()
