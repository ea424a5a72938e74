"""``omni-runtime generate --lora`` and the LoRA control calls in ``rpc --help``, through a subprocess;
the plain run the LoRA image is compared with also checks the params a generate reports."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

from omni_runtime.models.tiny_lora import build_tiny_sd_lora
from tests.entrypoints.test_cli import run


def generate(out: Path, *extra: str):
    # tiny-sd's default size and steps: the plain run checks that they are what the report says.
    return run("generate", "a red fox", "--seed", "7", "--out", str(out), "--quiet", *extra)


def image(out: Path) -> np.ndarray:
    [result] = json.loads((out / "report.json").read_text())["results"]
    return np.asarray(Image.open(result["files"][0]), dtype=np.int16)


def test_generate_with_a_lora_folder(tmp_path: Path) -> None:
    adapter = build_tiny_sd_lora(tmp_path / "ink", seed=1)
    runs = {
        "with": ("--lora", str(adapter), "--lora-scale", "0.8"),
        "plain": (),
        # Not a folder here: a name, which tiny-sd does not offer; the request fails, naming it.
        "unknown": ("--lora", "watercolor"),
        "bad": ("--lora", str(adapter), "--lora-scale", "nan"),
    }
    # Four independent CLI processes, run at once: each spends most of its time starting up.
    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: pool.submit(generate, tmp_path / name, *extra) for name, extra in runs.items()}
        done, plain, unknown, bad_scale = (futures[name].result() for name in runs)
    assert done.returncode == 0, done.stderr
    [result] = json.loads((tmp_path / "with" / "report.json").read_text())["results"]
    assert result["params"]["lora"] == {"path": str(adapter.resolve()), "scale": 0.8}
    assert plain.returncode == 0, plain.stderr
    [result] = json.loads((tmp_path / "plain" / "report.json").read_text())["results"]
    # tiny-sd's defaults, resolved: what the request ran with (the params' fallbacks too), not only
    # what was typed.
    expected = {"seed": 7, "num_inference_steps": 4, "guidance_scale": 7.5, "height": 64, "width": 64}
    assert result["params"] == {**expected, "output_type": "pil"}
    assert np.abs(image(tmp_path / "with") - image(tmp_path / "plain")).mean() > 1.0
    assert unknown.returncode == 1 and "unknown LoRA adapter 'watercolor'" in unknown.stderr
    assert bad_scale.returncode != 0 and "lora" in bad_scale.stderr


def test_rpc_help_lists_the_lora_calls() -> None:
    out = run("rpc", "--help")
    assert out.returncode == 0
    assert all(name in out.stdout for name in ("list_loras", "add_lora", "remove_lora"))
