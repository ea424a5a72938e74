"""A parallel stage behind the gateway: ``omni-runtime serve`` of two models, one of them a tiny-sd
whose replica is a 2-rank CFG-parallel group, with an API key and the Redis job store. The
image route through the ``openai`` client gives the image one process makes for the seed, a job
on that model completes through Redis, and the other model answers beside it."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import numpy as np
import openai
import pytest
from PIL import Image

from omni_runtime.config import StageConfig, load_config
from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest
from omni_runtime.stage.runners.diffusion import DiffusionRunner
from tests.helpers import diffusion_params

from .jobs_client import submit, wait_status
from .server_process import ServerProcess, flaky_echo_config, start_server, stop_server, wait_for, write_config

pytestmark = pytest.mark.e2e

KEY = "parallel-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, redis_server) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("parallel")
    sd = load_config("tiny-sd").stage_args[0]
    stage = {
        **msgspec.to_builtins(sd),
        "runtime": {"devices": "cpu", "torch_threads": 1, "parallel": {"cfg_parallel_size": 2}},
    }
    write_config(tmp / "par.yaml", {"model": "par", "stage_args": [stage]})
    flaky_echo_config(tmp / "echo.yaml", delay_ms=0)
    (tmp / "models.yaml").write_text("par: {config: par.yaml}\necho: {config: echo.yaml}\n")
    redis_url = redis_server.url.rsplit("/", 1)[0] + "/5"  # a database of its own
    srv = start_server("--models-file", str(tmp / "models.yaml"), "--api-key", KEY, "--redis-url", redis_url,
                       log=tmp / "server.log")  # fmt: skip
    try:
        # /health answers 200 once one model serves: the group is wanted loaded too.
        def loaded() -> bool:
            models = httpx.get(f"{srv.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
            return {m["id"]: m["state"] for m in models} == {"par": "loaded", "echo": "loaded"}

        assert wait_for(loaded, timeout=120), srv.log()[-3000:]
        yield srv
    finally:
        stop_server(srv)


def test_a_parallel_model_serves_images_and_jobs_beside_another(server: ServerProcess, model_cache: Path) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    image = client.images.generate(model="par", prompt="a fox", size="64x64", extra_body={"seed": 3})
    assert image.data and image.data[0].b64_json
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(image.data[0].b64_json))).convert("RGB"))
    alone = DiffusionRunner(msgspec.convert(load_config("tiny-sd").stage_args[0], StageConfig))
    alone.load()
    defaults = dict(load_config("tiny-sd").stage_args[0].default_sampling_params)
    request = RunnerRequest(request_id="r", prompt="a fox", params=diffusion_params({**defaults, "seed": 3}))
    (out,) = alone.execute([request], ExecuteContext(lambda rid: False))
    assert np.abs(served.astype(int) - np.asarray(out.media[0].data).astype(int)).max() <= 1
    answer = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "beside"}])
    assert answer.choices[0].message.content == "beside"
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        body = {"model": "par", "task": "text2image", "inputs": {"prompt": "a job", "size": "64x64", "seed": 4}}
        job = wait_status(http, submit(http, body)["job_id"], {"completed", "failed"}, timeout=60)
        assert job["status"] == "completed" and job["model"] == "par", job
        assert httpx.get(f"{server.url}/v1/models").status_code == 401  # the key guards it all
