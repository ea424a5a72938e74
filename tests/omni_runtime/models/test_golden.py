"""Golden outputs of the seeded builtin models: a fixed prompt and seed give fixed numbers, so a
silent change in a builder, a library upgrade or the pipeline defaults fails here first.

The slices were recorded with one torch thread on CPU (torch 2.13, diffusers 0.42,
transformers 5.x); compared with a tolerance, as batched and threaded kernels differ in the last
bits. A deliberate change re-records them.
"""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module", autouse=True)
def _cache(model_cache: object) -> None:
    """A private model cache and one torch thread (tests/conftest.py)."""


def test_tiny_sd_golden_slice() -> None:
    import torch
    from diffusers import DiffusionPipeline

    from omni_runtime.models.builtin import ensure_builtin
    from omni_runtime.models.families import family

    pipe = DiffusionPipeline.from_pretrained(ensure_builtin("tiny-sd"), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        "a cup of coffee",
        num_inference_steps=4,
        guidance_scale=7.5,
        height=64,
        width=64,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]
    # diffusers' own call makes the slice the runner does (test_diffusion_steps.py::test_golden_slice).
    np.testing.assert_allclose(image[-3:, -3:, -1].flatten(), family("sd").golden, atol=1e-3)


def test_tiny_lm_golden_logits() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omni_runtime.models.builtin import ensure_builtin

    path = ensure_builtin("tiny-lm")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.inference_mode():
        logits = model(tokenizer("a cup of coffee", return_tensors="pt").input_ids).logits[0, -1]
    expected = [1.3505, 3.4011, -3.8379, -0.1009, 0.1261, 0.0196]
    np.testing.assert_allclose(logits[:6].numpy(), expected, atol=1e-3)
    assert int(logits.argmax()) == 103
