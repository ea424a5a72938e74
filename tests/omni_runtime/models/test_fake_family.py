"""A family registered from outside the package (tests/omni_runtime/models/fake_family.py) is
served end to end, through ``Omni`` and a real ``omni-runtime serve``, by naming its module in the
stage's ``runner_args.families``: the caller imports it to check the builtin name, each stage
process before it loads the model. Its spec is what is read: its pipeline class (outside
diffusers) loads the model, its fixed call argument (no guidance) is applied, its size floor (16,
where the tiny SD's own step is 8) is the constraint the caller checks, and its callback style
(legacy: abort checks and progress, through ``callback``) is how the runner calls it."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import yaml
from PIL import Image

from omni_runtime import Omni
from omni_runtime.config import StageConfig
from omni_runtime.exceptions import InvalidRequestError, RequestAbortedError
from omni_runtime.models.builtin import CACHE_VERSION
from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from tests.entrypoints.openai.server_process import start_server, stop_server
from tests.helpers import diffusion_params

FAKE = "tests.omni_runtime.models.fake_family"


def config(tmp_path: Path) -> Path:
    data = {
        "model": "fake-family",
        "stage_args": [
            {
                "stage_id": 0,
                "stage_type": "diffusion",
                "model": "builtin:fake-family",
                "runtime": {"backend": "process", "num_replicas": 1, "devices": "cpu", "torch_threads": 1},
                "engine_args": {"max_num_seqs": 2, "request_batch_max_wait_ms": 0},
                "final_output": True,
                "final_output_type": "image",
                "default_sampling_params": {"num_inference_steps": 2, "height": 64, "width": 64},
                "runner_args": {"families": [FAKE]},
            }
        ],
    }
    path = tmp_path / "fake-family.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_served_by_omni(model_cache: Path, tmp_path: Path) -> None:
    with Omni(str(config(tmp_path))) as omni:
        plain, guided = (
            omni.generate(["a fox"], {"seed": 5, "guidance_scale": g}, use_tqdm=False)[0] for g in (1.0, 7.5)
        )
        # Its size floor is the step the caller checks: 72 is a multiple of the tiny SD's 8, not of 16.
        with pytest.raises(InvalidRequestError, match="not a multiple of 16") as info:
            omni.generate(["a fox"], {"height": 72}, use_tqdm=False)
        assert info.value.param == "height"
    assert plain.error is None and guided.error is None
    assert plain.images[0].size == (64, 64)
    # The family pins guidance_scale=1.0: asking for 7.5 makes the same image.
    assert np.array_equal(np.asarray(plain.images[0]), np.asarray(guided.images[0]))
    index = (model_cache / f"fake-family-{CACHE_VERSION}" / "model_index.json").read_text()
    assert '"FakeFamilyPipeline"' in index  # built by the family's own builder, in the stage process


def test_the_runner_reads_its_spec(model_cache: Path) -> None:
    """In the stage process' runner: the spec's size floor, and its legacy callback (the abort
    check runs at each step, and each step it did not abort is reported as progress)."""
    stage = msgspec.convert(
        {"stage_id": 0, "stage_type": "diffusion", "model": "builtin:fake-family", "runner_args": {"families": [FAKE]}},
        StageConfig,
    )
    runner = DiffusionRunner(stage)
    runner.load()
    constraints = runner.constraints()
    assert constraints.size_multiple == 16
    assert constraints.size_multiple_reason.endswith("and the pipeline takes multiples of 16 only")
    assert constraints.image_inputs == ()  # its spec names no image forms

    checks: list[str] = []
    progress: list[int] = []

    def aborted(rid: str) -> bool:
        checks.append(rid)
        return len(checks) > 2  # the caller leaves during the second step

    ctx = ExecuteContext(aborted, progress=lambda ids, step, steps: progress.append(step))
    params = diffusion_params({"num_inference_steps": 6, "height": 64, "width": 64, "seed": 1})
    request = RunnerRequest("a", "a fox", params)
    (out,) = runner.execute([request], ctx)
    assert isinstance(out.error, RequestAbortedError)
    assert progress == [1]  # the first step; the second one aborted
    steps: list[tuple[int, int]] = []
    done = runner.execute([request], ExecuteContext(lambda rid: False, progress=lambda ids, *s: steps.append(s)))
    assert done[0].error is None and steps == [(step, 6) for step in range(1, 7)]


def test_served_over_http(model_cache: Path, tmp_path: Path) -> None:
    server = start_server(str(config(tmp_path)), log=tmp_path / "server.log")
    try:
        images = []
        for guidance in (1.0, 7.5):
            body = {"prompt": "a fox", "seed": 5, "guidance_scale": guidance, "response_format": "b64_json"}
            r = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)
            assert r.status_code == 200, r.text
            png = base64.b64decode(r.json()["data"][0]["b64_json"])
            images.append(np.asarray(Image.open(io.BytesIO(png))))
        assert images[0].shape == (64, 64, 3) and np.array_equal(images[0], images[1])
    finally:
        stop_server(server)
