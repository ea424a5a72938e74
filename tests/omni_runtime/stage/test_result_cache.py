"""The exact-result cache without a model: which requests it takes (an explicit seed only), what
its key holds (the prompt, every params field, input images and upstream inputs), that a hit is a
copy the caller may write into, that errors, aborts and requests admitted before an invalidation
are never stored, and that outputs are bounded by their bytes."""

from __future__ import annotations

import numpy as np
import pytest

from omni_runtime.media import ImageItem
from omni_runtime.params import DiffusionSamplingParams, TextSamplingParams, resolve_params
from omni_runtime.stage.result_cache import ExactResultCache, output_bytes, request_digest
from omni_runtime.stage.runners.base import RunnerOutput

pytestmark = pytest.mark.unit


def params(**fields: object) -> DiffusionSamplingParams:
    return resolve_params(DiffusionSamplingParams, {}, {"seed": 7, **fields})


def image_output(value: int = 3, seed: int = 7) -> RunnerOutput:
    data = np.full((4, 4, 3), value, dtype=np.uint8)
    return RunnerOutput(media=[ImageItem(data=data, seed=seed)], metrics={"seed": seed, "execution_ms": 120.0})


def test_a_seeded_request_is_stored_and_the_same_request_is_a_hit() -> None:
    cache = ExactResultCache(2**20)
    assert cache.lookup("a", "a lighthouse", params(), {}) is None
    metrics = cache.finished("a", image_output())
    assert metrics == {"result_cache_hit": 0, "result_cache_bytes": 48, "result_cache_entries": 1}
    hit = cache.lookup("b", "a lighthouse", params(), {})
    assert hit is not None and hit.error is None
    np.testing.assert_array_equal(hit.media[0].data, image_output().media[0].data)
    # The timings were the first request's: only the seed is the output's own.
    assert hit.metrics == {"seed": 7}
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 1 and cache.stats()["pending"] == 0


def test_a_request_without_a_seed_is_never_looked_up_or_stored() -> None:
    cache = ExactResultCache(2**20)
    unseeded = resolve_params(DiffusionSamplingParams, {}, {})
    assert cache.lookup("a", "p", unseeded, {}) is None
    assert cache.finished("a", image_output()) == {}
    assert cache.lookup("b", "p", unseeded, {}) is None
    assert cache.stats()["misses"] == 0 and len(cache.store) == 0


@pytest.mark.parametrize(
    ("prompt", "fields", "inputs"),
    [
        ("another prompt", {}, {}),
        ("a lighthouse", {"seed": 8}, {}),
        ("a lighthouse", {"guidance_scale": 3.0}, {}),
        ("a lighthouse", {"negative_prompt": "fog"}, {}),
        ("a lighthouse", {"priority": 1}, {}),  # every field is in the key, even one that changes no pixel
        ("a lighthouse", {"lora": {"name": "oil", "scale": 0.5}}, {}),
        ("a lighthouse", {"image": np.zeros((8, 8, 3), np.uint8)}, {}),
        ("a lighthouse", {}, {"latents": np.zeros(3, np.float32)}),
    ],
)
def test_anything_else_that_differs_is_a_miss(prompt: str, fields: dict, inputs: dict) -> None:
    cache = ExactResultCache(2**20)
    cache.lookup("a", "a lighthouse", params(), {})
    cache.finished("a", image_output())
    assert cache.lookup("b", prompt, params(**fields), inputs) is None


def test_input_images_are_keyed_by_their_pixels() -> None:
    image = np.zeros((8, 8, 3), np.uint8)
    other = image.copy()
    other[0, 0, 0] = 1
    key = request_digest("p", params(image=image), {})
    assert key == request_digest("p", params(image=image.copy()), {})
    assert key != request_digest("p", params(image=other), {})
    # Same bytes, another shape or dtype: another key.
    four_bytes = request_digest("p", {}, {"x": np.zeros(4, np.uint8)})
    assert four_bytes != request_digest("p", {}, {"x": np.zeros(2, np.uint16)})
    assert four_bytes != request_digest("p", {}, {"x": np.zeros((2, 2), np.uint8)})


def test_values_of_similar_spelling_never_share_a_key() -> None:
    assert request_digest("ab", {}, {"c": ""}) != request_digest("a", {}, {"bc": ""})
    assert request_digest(1, {}, {}) != request_digest(1.0, {}, {}) != request_digest(True, {}, {})
    assert request_digest(["a", "b"], {}, {}) != request_digest(["ab"], {}, {})
    assert request_digest("p", {}, {}) == request_digest("p", {}, {})


def test_a_value_it_cannot_read_makes_the_request_uncacheable() -> None:
    cache = ExactResultCache(2**20)
    assert request_digest("p", params(), {"x": object()}) is None
    assert request_digest("p", params(), {"x": np.array([object()])}) is None
    assert cache.lookup("a", "p", params(), {"x": object()}) is None
    assert cache.finished("a", image_output()) == {}


def test_a_hit_is_a_copy_that_the_caller_may_write_into() -> None:
    cache = ExactResultCache(2**20)
    out = image_output()
    cache.lookup("a", "p", params(), {})
    cache.finished("a", out)
    out.media[0].data[:] = 255  # the first caller writes into what it got
    first = cache.lookup("b", "p", params(), {})
    assert first is not None
    assert int(first.media[0].data.max()) == 3
    first.media[0].data[:] = 200
    second = cache.lookup("c", "p", params(), {})
    assert second is not None and int(second.media[0].data.max()) == 3


def test_tensors_and_text_are_stored_too() -> None:
    cache = ExactResultCache(2**20)
    text = resolve_params(TextSamplingParams, {}, {"seed": 1})
    out = RunnerOutput(text="hello", tensors={"latents": np.ones((2, 2), np.float32)}, metrics={"seed": 1})
    assert output_bytes(out) == 5 + 16
    cache.lookup("a", "hi", text, {})
    cache.finished("a", out)
    hit = cache.lookup("b", "hi", text, {})
    assert hit is not None and hit.text == "hello"
    np.testing.assert_array_equal(hit.tensors["latents"], out.tensors["latents"])
    assert hit.tensors["latents"] is not out.tensors["latents"]


def test_text_weighs_its_utf8_bytes_not_its_characters() -> None:
    """Four-byte characters: a text of 1,000 of them holds 4,000 bytes, past a 3,000-byte bound
    (counted as 1,000, it was stored, and such texts filled four times the bound)."""
    cache = ExactResultCache(3000)
    text = resolve_params(TextSamplingParams, {}, {"seed": 1})
    out = RunnerOutput(text="\U0001f600" * 1000, metrics={"seed": 1})
    assert output_bytes(out) == 4000
    cache.lookup("a", "hi", text, {})
    cache.finished("a", out)
    assert cache.stats()["refused"] == 1 and cache.stats()["entries"] == 0


def test_errors_aborts_and_requests_admitted_before_an_invalidation_are_not_stored() -> None:
    cache = ExactResultCache(2**20)
    cache.lookup("failed", "p", params(), {})
    assert cache.finished("failed", RunnerOutput(error=RuntimeError("boom")))["result_cache_entries"] == 0
    cache.lookup("aborted", "p", params(), {})
    cache.forget("aborted")
    assert cache.finished("aborted", image_output()) == {}
    cache.lookup("old", "p", params(), {})
    cache.invalidate()  # add_lora, sleep...: it ran on the model as it was
    assert cache.finished("old", image_output())["result_cache_entries"] == 0
    assert len(cache.store) == 0 and cache.stats()["pending"] == 0


def test_invalidation_drops_what_is_stored() -> None:
    cache = ExactResultCache(2**20)
    cache.lookup("a", "p", params(), {})
    cache.finished("a", image_output())
    cache.invalidate()
    assert cache.lookup("b", "p", params(), {}) is None
    assert cache.stats()["invalidations"] == 1 and cache.stats()["entries"] == 0


def test_outputs_are_bounded_by_their_bytes() -> None:
    cache = ExactResultCache(100)  # two 48-byte images fit, a third evicts the oldest
    for seed in (1, 2, 3):
        cache.lookup(f"r{seed}", "p", params(seed=seed), {})
        metrics = cache.finished(f"r{seed}", image_output(seed=seed))
    assert metrics["result_cache_evictions"] == 1 and metrics["result_cache_bytes"] == 96
    assert cache.lookup("x", "p", params(seed=1), {}) is None
    assert cache.lookup("y", "p", params(seed=3), {}) is not None
    big = RunnerOutput(tensors={"latents": np.zeros(200, np.uint8)}, metrics={"seed": 9})
    cache.lookup("big", "p", params(seed=9), {})
    cache.finished("big", big)  # past the whole bound: refused, nothing evicted
    assert cache.stats()["refused"] == 1 and cache.stats()["entries"] == 2
