"""Every ``omni-runtime`` subcommand through a subprocess, and its bad arguments."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import socket
import subprocess
import sys

import httpx
import psutil
import pytest
import yaml
from PIL import Image

from tests.entrypoints.openai.server_process import (
    CLI,
    REPO,
    ServerProcess,
    start_server,
    stop_server,
    stop_servers,
    write_config,
)

KEY = "sk-cli"


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory):
    srv = start_server("echo", "--api-key", KEY, log=tmp_path_factory.mktemp("cli") / "server.log")
    yield srv
    stop_server(srv)


def test_validate_prints_the_resolved_config():
    out = run("validate", "tiny-sd")
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    stage = config["stage_args"][0]
    assert stage["stage_type"] == "diffusion" and stage["engine_args"]["max_num_seqs"] == 4
    assert stage["runtime"]["max_restarts"] == 3  # defaults are filled in: the resolved config
    as_json = run("validate", str(REPO / "stage_configs" / "echo.yaml"), "--format", "json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["model"] == "echo"


def test_validate_reports_the_bad_key(tmp_path):
    bad = write_config(
        tmp_path / "bad.yaml",
        {"stage_args": [{"stage_id": 0, "stage_type": "echo", "engine_args": {"max_num_seqs": 0}}]},
    )
    out = run("validate", str(bad))
    assert out.returncode == 1 and out.stdout == ""
    assert "stage_args[0].engine_args.max_num_seqs" in out.stderr and out.stderr.startswith("error:")
    missing = run("validate", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 1 and "not found" in missing.stderr


def test_models_lists_bundled_configs_and_builtins():
    out = run("models")
    assert out.returncode == 0
    assert "tiny-sd" in out.stdout and "echo" in out.stdout and "tiny-lm" in out.stdout
    data = json.loads(run("models", "--json").stdout)
    assert {"tiny-sd", "echo", "tiny-stable-audio"} <= {c["name"] for c in data["configs"]}
    assert {"tiny-sd", "tiny-stable-audio"} <= set(data["builtin_models"])
    assert "tiny-stable-audio  diffusion->audio" in out.stdout
    assert "tiny-tts" in set(data["builtin_models"]) and "tiny-tts           speech->audio" in out.stdout


def test_generate_writes_pngs_and_a_report_with_step_execution(tmp_path):
    # One engine start for both: request-level generate is run by the other generate tests
    # (and the plain run of test_cli_lora.py).
    out = run(
        "generate",
        "a cat",
        "a dog",
        "-n",
        "2",
        "--seed",
        "7",
        "--steps",
        "2",
        "--size",
        "32x40",
        "--step-execution",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    assert "generate" in out.stderr  # the tqdm progress bar
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["requests"] == 4 and report["images"] == 4 and report["failed"] == 0
    assert [r["seed"] for r in report["results"]] == [7, 8, 7, 8]
    assert [r["prompt"] for r in report["results"]] == ["a cat", "a cat", "a dog", "a dog"]
    for r in report["results"]:
        assert r["metrics"]["e2e_ms"] > 0 and r["metrics"]["batch_size"] >= 1
        assert r["metrics"]["steps_run"] == 2  # only step execution reports it
        (path,) = r["files"]
        assert Image.open(path).size == (32, 40)


def test_generate_writes_videos_that_pyav_decodes_from_a_first_frame(tmp_path):
    import av
    from PIL import Image

    first = tmp_path / "first.png"  # image to video: the video takes the image's size (not the model's 32x32)
    Image.new("RGB", (48, 32), (200, 40, 40)).save(first)
    out = run("generate", "--model", "tiny-wan", "a boat", "--image", str(first), "--frames", "9", "--fps", "8",
              "--steps", "2", "--seed", "1", "--out", str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "generate" in out.stderr and "step" in out.stderr  # the progress bar counts steps
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["videos"] == 1 and report["failed"] == 0
    assert report["results"][0]["params"]["num_frames"] == 9
    assert report["params"]["image"] == report["results"][0]["params"]["image"] == str(first)
    (path,) = report["results"][0]["files"]
    assert path.endswith(".mp4")
    with av.open(path) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(stream))
        assert stream.average_rate == 8
    assert len(frames) == 9 and (frames[0].width, frames[0].height) == (48, 32)


def test_generate_refuses_frames_for_an_image_model(tmp_path):
    out = run("generate", "a cat", "--frames", "9", "--out", str(tmp_path))
    assert out.returncode != 0 and "--frames" in out.stderr


def test_generate_writes_wav_files_of_the_asked_length(tmp_path):
    import soundfile

    out = run("generate", "--model", "tiny-stable-audio", "rain", "-n", "2", "--seconds", "0.5", "--steps", "2",
              "--seed", "3", "--out", str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["audios"] == 2 and report["failed"] == 0 and [r["seed"] for r in report["results"]] == [3, 4]
    assert report["results"][0]["params"]["audio_end_in_s"] == 0.5
    for r in report["results"]:
        (path,) = r["files"]
        info = soundfile.info(path)
        assert path.endswith(".wav") and (info.samplerate, info.channels, info.frames) == (16_000, 2, 8000)
    refused = run("generate", "a cat", "--seconds", "1", "--out", str(tmp_path / "no"))
    assert refused.returncode != 0 and "--seconds is for an audio model" in refused.stderr


def test_generate_speaks_wav_files_with_a_voice_and_speed(tmp_path):
    import soundfile

    out = run("generate", "--model", "tiny-tts", "hello there", "--voice", "echo", "--speed", "1.5", "--seed", "2",
              "--out", str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    (result,) = report["results"]
    assert report["audios"] == 1 and result["params"] == {"voice": "echo", "speed": 1.5, "seed": 2}
    info = soundfile.info(result["files"][0])
    assert result["files"][0].endswith(".wav") and (info.samplerate, info.channels) == (16_000, 1)
    assert info.frames == result["metrics"]["audio_samples"]
    refused = run("generate", "a cat", "--voice", "alloy", "--out", str(tmp_path / "no"))
    assert refused.returncode != 0 and "--voice and --speed are for a speech model" in refused.stderr


def test_generate_sends_image_params_to_every_stage_that_takes_them(tmp_path):
    # In the split pipeline the seed and size belong to the denoiser, not the final decoder.
    out = run(
        "generate",
        "a cat",
        "--model",
        "tiny-sd-split",
        "--seed",
        "11",
        "--size",
        "32x48",
        "--steps",
        "2",
        "--out",
        str(tmp_path),
    )
    assert out.returncode == 0, out.stderr
    [result] = json.loads((tmp_path / "report.json").read_text())["results"]
    assert result["seed"] == 11
    assert Image.open(result["files"][0]).size == (32, 48)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "required"),
        (("serve", "--port", "70000"), "between 1 and 65535"),
        (("serve", "--max-num-seqs", "0"), ">= 1"),
        (("serve", "--step-execution=yes"), "ignored explicit argument"),
        (("serve", "--shutdown-timeout", "soon"), "expected a number"),
        (("generate", "x", "-n", "0"), ">= 1"),
        (("generate", "x", "--size", "10x"), "size must look like"),
        (("rpc", "ping", "--kwargs", "{bad"), "not valid JSON"),
        (("rpc", "ping", "--kwargs", "[1]"), "expected a JSON dict"),
        (("rpc", "ping", "--url", "localhost:8000"), "http://"),
        (("bench", "--concurrency", "-2"), ">= 1"),
        (("bench", "--rate", "0"), "> 0"),
    ],
)
def test_bad_arguments_are_a_message_and_exit_2(args, message):
    out = run(*args, timeout=30)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_serve_fails_clearly_on_an_unknown_model_or_a_busy_port():
    out = run("serve", "no-such-model", timeout=30)
    assert out.returncode == 1 and "unknown model 'no-such-model'" in out.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        out = run("serve", "echo", "--port", str(busy.getsockname()[1]), timeout=30)
    assert out.returncode == 1 and "cannot listen on 127.0.0.1" in out.stderr


def test_rpc_against_a_running_server(echo_server):
    ok = run("rpc", "get_stats", "--url", echo_server.url, "--api-key", KEY, "--stage-ids", "0", "--timeout", "5")
    assert ok.returncode == 0, ok.stderr
    (result,) = json.loads(ok.stdout)
    assert result["ok"] and result["result"]["stage_id"] == 0
    unknown = run("rpc", "frobnicate", "--url", echo_server.url, "--api-key", KEY)
    assert unknown.returncode == 1 and "frobnicate" in unknown.stderr
    denied = run("rpc", "ping", "--url", echo_server.url)
    assert denied.returncode == 1 and "HTTP 401" in denied.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    unreachable = run("rpc", "ping", "--url", f"http://127.0.0.1:{closed}")
    assert unreachable.returncode == 1 and "cannot reach" in unreachable.stderr


def test_bench_against_a_running_server(echo_server, tmp_path):
    args = ["bench", "--url", echo_server.url, "--api-key", KEY, "--endpoint", "chat", "--total", "12"]
    out = run(
        *args,
        "--concurrency",
        "3",
        "--rate",
        "50",
        "--json",
        str(tmp_path / "b.json"),
        "--plot",
        str(tmp_path / "b.png"),
    )
    assert out.returncode == 0, out.stderr
    assert "p50 ms" in out.stdout and "12/12" in out.stdout.replace(" ", "")
    report = json.loads((tmp_path / "b.json").read_text())
    summary = report["summary"]
    assert summary["ok"] == 12 and summary["errors"] == 0 and summary["requests_per_s"] > 0
    assert summary["latency_ms"]["p50"] <= summary["latency_ms"]["p99"]
    assert len(report["samples"]) == 12
    assert Image.open(tmp_path / "b.png").size[0] > 100
    denied = run("bench", "--url", echo_server.url, "--endpoint", "chat", "--total", "2")
    assert denied.returncode == 1 and "401" in denied.stderr


@pytest.mark.parametrize("command", ["serve", "generate", "validate", "worker", "models", "rpc", "bench"])
def test_every_command_has_help_with_defaults_and_examples(command):
    out = run(command, "--help")
    assert out.returncode == 0 and out.stdout.count("\n") > 5
    assert "examples:" in out.stdout
    if command in ("serve", "generate", "bench"):
        assert "(default:" in out.stdout
    if command == "rpc":
        for method in ("ping", "get_stats", "set_batching", "sleep", "wake_up"):
            assert method in out.stdout


def test_piping_into_head_exits_quietly(echo_server):
    for command in (
        f"{' '.join(CLI)} models --json | head -1",
        f"{' '.join(CLI)} rpc ping --url {echo_server.url} --api-key {KEY} | head -1",
    ):
        out = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=REPO, capture_output=True, text=True)
        assert out.stdout.strip() and "Error" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_client_commands_read_the_api_key_from_the_environment(echo_server):
    env = {**__import__("os").environ, "OMNI_RUNTIME_API_KEY": KEY}
    out = subprocess.run(
        [*CLI, "rpc", "ping", "--url", echo_server.url], cwd=REPO, capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    refused = subprocess.run([*CLI, "rpc", "ping", "--url", echo_server.url], cwd=REPO, capture_output=True, text=True)
    assert refused.returncode == 1 and "401" in refused.stderr


def test_serve_reads_its_key_from_the_environment_or_a_file(tmp_path):
    """Neither way puts the key on the command line (``ps`` shows it to every local user)."""
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    by_env = ServerProcess("echo", log=tmp_path / "env.log", env={"OMNI_RUNTIME_API_KEY": "sk-from-env"})
    by_file = ServerProcess("echo", "--api-key-file", str(key_file), log=tmp_path / "file.log")
    servers = [by_env, by_file]
    try:
        for server in servers:
            server.wait_ready()
        for server, key in ((by_env, "sk-from-env"), (by_file, "sk-from-file")):
            assert key not in " ".join(psutil.Process(server.pid).cmdline())
            assert httpx.get(f"{server.url}/v1/models").status_code == 401
            assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
            ok = httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200, ok.text
    finally:
        stop_servers(*servers)


def test_serve_refuses_a_key_given_two_ways_or_empty(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("sk-file")
    empty = tmp_path / "empty"
    empty.write_text(" \n")
    env = {**os.environ, "OMNI_RUNTIME_API_KEY": "sk-env"}
    cases = [
        (["--api-key", "sk-arg", "--api-key-file", str(key_file)], None, "--api-key and --api-key-file"),
        (["--api-key", "sk-arg"], env, "--api-key and $OMNI_RUNTIME_API_KEY"),
        (["--api-key-file", str(key_file)], env, "--api-key-file and $OMNI_RUNTIME_API_KEY"),
        (["--api-key-file", str(empty)], None, "--api-key-file: the API key is empty"),
        (["--api-key-file", str(tmp_path / "missing")], None, "--api-key-file: cannot read"),
    ]
    for args, case_env, message in cases:
        out = subprocess.run(
            [*CLI, "serve", "echo", *args, "--port", "1"], cwd=REPO, capture_output=True, text=True, env=case_env
        )
        assert out.returncode == 1 and message in out.stderr, out.stderr


def test_ctrl_c_during_generate_exits_promptly_with_a_partial_report(tmp_path):
    import signal
    import time

    # As from a terminal: SIGINT handled by default, even when this test runs where it is ignored
    # (a run started in the background by a non-interactive shell: its children inherit SIG_IGN,
    # and Python then leaves Ctrl-C ignored). PYTHONFAULTHANDLER: a CLI that does not exit is made
    # to print every thread's stack (SIGABRT).
    as_terminal = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "runpy.run_module('omni_runtime.entrypoints.cli', run_name='__main__', alter_sys=True)"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            as_terminal,
            "generate",
            "a slow one",
            "-n",
            "64",
            "--steps",
            "50",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )
    family: list[psutil.Process] = []
    try:
        # Interrupt while images are drawn: once the step bar (carriage returns, no newline) has moved.
        stepped = re.compile(rb"generating .*\|\s*[1-9]\d*/3200 ", re.DOTALL)
        deadline = time.monotonic() + 120
        err = b""
        while not stepped.search(err):
            assert time.monotonic() < deadline and proc.poll() is None, f"generate never stepped: {err[-500:]!r}"
            if select.select([proc.stderr], [], [], 0.5)[0]:
                err += os.read(proc.stderr.fileno(), 65536)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        # Read what it still writes while it exits: a full pipe would block its last writes (and the
        # test would time out on a process waiting for its reader).
        try:
            _, rest = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            family = psutil.Process(proc.pid).children(recursive=True)  # before they are orphaned
            proc.send_signal(signal.SIGABRT)
            _, stacks = proc.communicate(timeout=15)
            pytest.fail(
                f"generate had not exited 30 s after SIGINT; its threads:\n{stacks.decode(errors='replace')[-8000:]}"
            )
        assert proc.returncode == 130 and time.monotonic() - start < 15, (err + rest)[-2000:]
    finally:
        # Whatever failed above, its engine's processes do not outlive the test (and fail the next).
        if proc.poll() is None:
            family += psutil.Process(proc.pid).children(recursive=True)
        for p in [*family, proc]:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                p.kill()
        proc.wait(10)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["interrupted"] and report["requests"] == 64
    assert any(r.get("error") == "not finished (interrupted)" for r in report["results"])
