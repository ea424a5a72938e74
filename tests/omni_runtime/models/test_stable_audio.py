"""The Stable Audio family: its tiny builtin end to end through ``Omni``, and the audio params.

``Omni("tiny-stable-audio")`` returns audio clips (float32 ``channels x n`` at the model's rate)
that save as WAV files soundfile reads back; requests of one length fuse into one wave whose clips
equal their solo clips (within float tolerance); a clip past the model's window is refused before
it is queued, naming the limit; the golden slice pins the seeded builder and the pipeline (a
second build here would cost more of the suite's time than it guards). The params' validation
takes hostile values without an engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime import Omni
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.messages import StageConstraints
from omni_runtime.models.families import GOLDEN_PARAMS, GOLDEN_PROMPT, family
from omni_runtime.params import DiffusionSamplingParams, check_constraints, resolve_params

SPEC = family("stable_audio")
#: What tiny-stable-audio reports: stereo at 16 kHz, a window of 64 latents x 512 samples.
RATE, CHANNELS, MAX_S = 16_000, 2, 2.048
AUDIO = StageConstraints(max_audio_s=MAX_S, audio_reason="the window")


# ---------------------------------------------------------------------------- params (unit)


@pytest.mark.unit
@given(
    end=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(), st.text(max_size=3)),
    start=st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 5)),
    waves=st.one_of(st.none(), st.integers(), st.floats(), st.booleans()),
)
@settings(max_examples=150, deadline=None)
def test_hostile_audio_params_are_invalid_request_errors_naming_the_field(end: Any, start: Any, waves: Any) -> None:
    params = {"audio_end_in_s": end, "audio_start_in_s": start, "num_waveforms_per_prompt": waves}
    try:
        resolved = resolve_params(DiffusionSamplingParams, {}, params)
        check_constraints(resolved, AUDIO)
    except InvalidRequestError as e:
        assert e.param in ("audio_end_in_s", "audio_start_in_s", "num_waveforms_per_prompt")
        return
    # Accepted: a clip the model can make, of a sane count.
    span_end = MAX_S if resolved.audio_end_in_s is None else resolved.audio_end_in_s
    assert 0 <= (resolved.audio_start_in_s or 0.0) < span_end <= MAX_S
    assert 1 <= (resolved.num_waveforms_per_prompt or 1) <= 16


@pytest.mark.unit
def test_audio_params_are_refused_by_a_stage_that_makes_no_audio() -> None:
    for name, value in (("audio_end_in_s", 1.0), ("audio_start_in_s", 0.5), ("num_waveforms_per_prompt", 2)):
        with pytest.raises(InvalidRequestError, match="makes no audio") as info:
            check_constraints({name: value}, StageConstraints(size_multiple=8))
        assert info.value.param == name
    with pytest.raises(InvalidRequestError, match="num_waveforms_per_prompt") as info:
        check_constraints({"num_images_per_prompt": 2}, AUDIO)
    assert info.value.param == "num_images_per_prompt"


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def omni(model_cache: Path) -> Any:
    with Omni("tiny-stable-audio", torch_threads=1) as engine:  # one torch thread (see model_cache)
        yield engine


@pytest.mark.integration
def test_python_api_makes_audio_that_saves_as_wav(omni: Any, tmp_path: Path) -> None:
    (out,) = omni.generate("rain", {"audio_end_in_s": 1.0, "seed": 1}, use_tqdm=False)
    assert out.error is None and out.images == [] and out.videos == []
    (clip,) = out.audios
    assert clip.samples.dtype == np.float32 and clip.samples.shape == (CHANNELS, RATE)
    assert (clip.sample_rate, clip.channels, clip.num_samples, clip.duration_s, clip.seed) == (RATE, 2, RATE, 1.0, 1)
    assert np.abs(clip.samples).max() <= 1.0 and clip.samples.std() > 0
    clip.save(tmp_path / "a.wav")
    samples, rate = soundfile.read(tmp_path / "a.wav", dtype="float32", always_2d=True)
    assert rate == RATE and samples.shape == (RATE, CHANNELS)
    assert np.abs(samples.T - clip.samples).max() <= 1 / 32767 + 1e-6


@pytest.mark.integration
def test_clips_per_prompt_and_a_start_cut_the_asked_span(omni: Any) -> None:
    (out,) = omni.generate(
        "wind",
        {"audio_start_in_s": 0.25, "audio_end_in_s": 0.75, "num_waveforms_per_prompt": 2, "seed": 5},
        use_tqdm=False,
    )
    assert [(c.samples.shape, c.seed) for c in out.audios] == [((CHANNELS, RATE // 2), 5), ((CHANNELS, RATE // 2), 6)]
    assert np.abs(out.audios[0].samples - out.audios[1].samples).max() > 1e-3  # two draws, not one twice


@pytest.mark.integration
def test_batched_clips_equal_their_solo_clips(omni: Any) -> None:
    prompts = ["rain on a roof", "a dog barking far away"]
    together = omni.generate(prompts, {"seed": 3}, use_tqdm=False)
    assert [o.metrics["batch_size"] for o in together] == [2, 2]
    for prompt, fused in zip(prompts, together, strict=True):
        (solo,) = omni.generate(prompt, {"seed": 3}, use_tqdm=False)
        np.testing.assert_allclose(fused.audios[0].samples, solo.audios[0].samples, atol=1e-4)
    assert np.abs(together[0].audios[0].samples - together[1].audios[0].samples).max() > 1e-3


@pytest.mark.integration
@pytest.mark.parametrize(
    ("params", "param", "match"),
    [
        ({"audio_end_in_s": 3.0}, "audio_end_in_s", r"past the 2.048 s .*window of 64 latents x 512 samples"),
        ({"audio_start_in_s": 1.0, "audio_end_in_s": 1.0}, "audio_start_in_s", "not before the clip's end"),
        ({"audio_end_in_s": 0}, "audio_end_in_s", "> 0"),
        ({"num_frames": 5}, "num_frames", "not videos"),
    ],
)
def test_bad_audio_params_are_refused_before_queueing(omni: Any, params: dict, param: str, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match) as info:
        omni.generate("rain", params, use_tqdm=False)
    assert info.value.param == param


@pytest.mark.integration
def test_golden_slice(omni: Any) -> None:
    (out,) = omni.generate(GOLDEN_PROMPT, dict(GOLDEN_PARAMS), use_tqdm=False)
    got = [round(float(v), 4) for v in out.tensors["audios"][0, :, -4:].flatten()]
    assert SPEC.golden, f"stable_audio: no golden slice stored; this run made {got}"
    np.testing.assert_allclose(got, SPEC.golden, rtol=0, atol=1e-3, err_msg=f"tiny-stable-audio made {got}")
