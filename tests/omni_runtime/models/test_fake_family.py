"""A family registered from outside the package (tests/omni_runtime/models/fake_family.py) is
served end to end, through ``Omni`` and a real ``omni-runtime serve``, by naming its module in the
stage's ``runner_args.families``: the caller imports it to check the builtin name, each stage
process before it loads the model. Its spec is what is read: its pipeline class (outside
diffusers) loads the model and its fixed call argument (no guidance) is applied."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import yaml
from PIL import Image

from omni_runtime import Omni
from omni_runtime.models.builtin import CACHE_VERSION
from tests.entrypoints.openai.server_process import start_server, stop_server

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
    assert plain.error is None and guided.error is None
    assert plain.images[0].size == (64, 64)
    # The family pins guidance_scale=1.0: asking for 7.5 makes the same image.
    assert np.array_equal(np.asarray(plain.images[0]), np.asarray(guided.images[0]))
    index = (model_cache / f"fake-family-{CACHE_VERSION}" / "model_index.json").read_text()
    assert '"FakeFamilyPipeline"' in index  # built by the family's own builder, in the stage process


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
