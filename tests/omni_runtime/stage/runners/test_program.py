"""The ``subprocess`` stage against hostile programs (``hostile_program.py``), runner first, then
through an engine.

Each hostile run (never answers, floods its standard output, exits mid-request, writes a huge, a
corrupt or a linked output, ignores SIGTERM) fails its request alone with a typed error, within
its bound; the process group it made (the program and the child it started) is gone afterwards;
the folder of the request is removed; and the same runner serves the next request. A request's
params and prompt reach the program verbatim, one argument each, whatever shell metacharacters
they hold (hypothesis).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_runtime import Omni
from omni_runtime.config import parse_config
from omni_runtime.exceptions import (
    InvalidRequestError,
    ProgramError,
    ProgramTimeoutError,
    RequestAbortedError,
    StageDeadError,
)
from omni_runtime.params import GenericSamplingParams, resolve_params
from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest
from omni_runtime.stage.runners.program import ProgramRunner

pytestmark = pytest.mark.integration

HELPER = str(Path(__file__).with_name("hostile_program.py"))


def stage_config(pids: Path, **runner_args: Any) -> dict[str, Any]:
    args = {
        "argv": [sys.executable, "-I", HELPER, "{mode}", "{output}", "{arg}"],
        "outputs": [{"name": "output", "path": "out.json", "kind": "text"}],
        "env": {"PIDS_DIR": str(pids)},
        "timeout_s": 5,
        "kill_grace_s": 0.3,
        "max_stdout_bytes": 1 << 16,
        "max_output_bytes": 1 << 20,
        **runner_args,
    }
    return {
        "stage_id": 0,
        "stage_type": "subprocess",
        "final_output": True,
        "final_output_type": "text",
        "default_sampling_params": {"arg": "-"},
        "runner_args": args,
    }


@pytest.fixture
def pids(tmp_path: Path) -> Path:
    folder = tmp_path / "pids"
    folder.mkdir()
    return folder


def runner_for(pids: Path, **runner_args: Any) -> ProgramRunner:
    config = parse_config({"stage_args": [stage_config(pids, **runner_args)]})
    runner = ProgramRunner(config.stage_args[0])
    runner.load()
    return runner


def request(
    runner: ProgramRunner, mode: str, prompt: str = "hi", request_id: str = "r", **params: Any
) -> RunnerRequest:
    resolved = resolve_params(GenericSamplingParams, runner.stage.default_sampling_params, {"mode": mode, **params})
    return RunnerRequest(request_id=request_id, prompt=prompt, params=resolved)


def run(runner: ProgramRunner, *reqs: RunnerRequest, aborted: set[str] | None = None) -> list[Any]:
    ctx = ExecuteContext(lambda rid: rid in (aborted or set()))
    return runner.execute(list(reqs), ctx)


def assert_nothing_left(pids: Path) -> None:
    """Every process the program recorded (itself, its child) is gone (or a zombie that is not
    ours to reap), and no request folder is left."""
    recorded = [int(p.name) for p in pids.iterdir()]
    assert recorded, "the program recorded no pid"
    deadline = time.monotonic() + 3
    for pid in recorded:
        while time.monotonic() < deadline:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)
        else:
            raise AssertionError(f"process {pid} of the program is still running")
        try:
            os.killpg(pid, 0)  # the program's own group (its pid): nobody running in it
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass


def serves_next(runner: ProgramRunner) -> None:
    (out,) = run(runner, request(runner, "ok", prompt="next", arg="again"))
    assert out.error is None, out.error
    assert json.loads(out.text) == {"argv": ["again"], "stdin": "next"}


def test_a_good_run_reads_its_output_and_stdin(pids: Path) -> None:
    runner = runner_for(pids)
    outs = run(runner, *(request(runner, "ok", prompt=f"p{i}", request_id=f"r{i}", arg=str(i)) for i in range(3)))
    assert [json.loads(o.text) for o in outs] == [{"argv": [str(i)], "stdin": f"p{i}"} for i in range(3)]
    assert all(o.metrics["batch_size"] == 3 for o in outs)
    assert_nothing_left(pids)


def test_a_program_that_never_answers_times_out_and_its_group_is_killed(pids: Path) -> None:
    runner = runner_for(pids, timeout_s=0.5)
    started = time.monotonic()
    (out,) = run(runner, request(runner, "hang"))
    assert isinstance(out.error, ProgramTimeoutError), out.error
    assert "timeout of 0.5 s" in str(out.error)
    assert time.monotonic() - started < 3
    assert_nothing_left(pids)
    serves_next(runner)


def test_an_abort_kills_the_group_at_once(pids: Path) -> None:
    runner = runner_for(pids)
    calls = {"n": 0}

    def aborted(rid: str) -> bool:
        calls["n"] += 1
        return calls["n"] > 5  # aborted while it runs

    started = time.monotonic()
    (out,) = runner.execute([request(runner, "hang")], ExecuteContext(aborted))
    assert isinstance(out.error, RequestAbortedError)
    assert time.monotonic() - started < 2
    assert_nothing_left(pids)


def test_a_flood_of_stdout_is_bounded_and_fails_the_request(pids: Path) -> None:
    runner = runner_for(pids)
    peak = psutil.Process().memory_info().rss
    (out,) = run(runner, request(runner, "flood"))
    assert isinstance(out.error, ProgramError), out.error
    assert f"more than {1 << 16} bytes to its standard output" in str(out.error)
    assert psutil.Process().memory_info().rss - peak < 64 << 20
    assert_nothing_left(pids)
    serves_next(runner)


def test_an_exit_mid_request_is_a_typed_error_quoting_stderr(pids: Path) -> None:
    runner = runner_for(pids)
    (out,) = run(runner, request(runner, "exit"))
    assert isinstance(out.error, ProgramError)
    assert "exited with status 3" in str(out.error) and "boom: the model fell over" in str(out.error)
    assert_nothing_left(pids)
    serves_next(runner)


def test_a_huge_output_file_is_stopped_at_its_bound(pids: Path) -> None:
    runner = runner_for(pids, outputs=[{"name": "output", "path": "out.bin", "kind": "text"}])
    (out,) = run(runner, request(runner, "huge"))
    assert isinstance(out.error, ProgramError), out.error
    assert f"past {1 << 20} bytes" in str(out.error)
    assert_nothing_left(pids)


def test_a_corrupt_or_linked_output_is_a_typed_error(pids: Path) -> None:
    runner = runner_for(pids, outputs=[{"name": "output", "path": "out.wav", "kind": "audio"}])
    corrupt, linked = run(runner, request(runner, "corrupt", request_id="a"), request(runner, "link", request_id="b"))
    assert isinstance(corrupt.error, ProgramError) and "not a readable audio file" in str(corrupt.error)
    assert isinstance(linked.error, ProgramError) and "not a regular file" in str(linked.error)
    assert_nothing_left(pids)


def test_an_audio_output_that_decodes_past_its_bound_is_refused_unread(pids: Path) -> None:
    """A decompression bomb: 350 KB of FLAC, within max_output_bytes, that would decode to 1.3 GB
    of samples (the stage's memory), is refused from its header."""
    runner = runner_for(pids, outputs=[{"name": "output", "path": "out.flac", "kind": "audio"}])
    peak = psutil.Process().memory_info().rss
    (out,) = run(runner, request(runner, "bomb"))
    assert type(out.error) is ProgramError and "bytes of samples, past" in str(out.error), out.error
    assert psutil.Process().memory_info().rss - peak < 256 << 20
    assert_nothing_left(pids)


def test_a_program_that_ignores_sigterm_is_killed_after_the_grace(pids: Path) -> None:
    runner = runner_for(pids, timeout_s=0.3, kill_grace_s=0.5)
    started = time.monotonic()
    (out,) = run(runner, request(runner, "stubborn"))
    took = time.monotonic() - started
    assert isinstance(out.error, ProgramTimeoutError)
    assert 0.8 <= took < 3, took  # the timeout, then the whole grace, then SIGKILL
    assert_nothing_left(pids)
    serves_next(runner)


def test_a_missing_param_or_a_nul_is_refused_before_anything_runs(pids: Path) -> None:
    runner = runner_for(pids)
    (nul,) = run(runner, request(runner, "ok", arg="a\x00b"))
    assert isinstance(nul.error, InvalidRequestError) and nul.error.param == "arg"
    resolved = resolve_params(GenericSamplingParams, {}, {"arg": "x"})
    (missing,) = run(runner, RunnerRequest(request_id="m", prompt="p", params=resolved))
    assert isinstance(missing.error, InvalidRequestError) and missing.error.param == "mode"
    assert not list(pids.iterdir())


def test_a_value_past_the_systems_argument_limit_is_the_requests_error(pids: Path) -> None:
    """A value the kernel refuses as an argument (over 128 KiB; a 100,000-character prompt of
    4-byte characters in ``prompt: argv``) is the request's bad input, not the stage's failure."""
    runner = runner_for(pids)
    (big,) = run(runner, request(runner, "ok", arg="x" * 200_000))
    assert type(big.error) is InvalidRequestError and "too long" in str(big.error), big.error
    assert not list(pids.iterdir())
    serves_next(runner)


def test_a_wave_that_fails_to_start_stops_the_programs_it_started(pids: Path) -> None:
    """A request the runner cannot start for a reason it does not map (here a prompt no file can
    hold: a caller that skipped the engine's checks) fails the wave, which the worker runs again
    one by one; the program already started for the other request is stopped, not left running
    beside its retry."""
    runner = runner_for(pids)
    with pytest.raises(UnicodeEncodeError):
        run(runner, request(runner, "sleep", request_id="a"), request(runner, "ok", prompt="\ud800", request_id="b"))
    running = [
        c.pid
        for c in psutil.Process().children(recursive=True)
        if c.status() != psutil.STATUS_ZOMBIE and HELPER in " ".join(c.cmdline())
    ]
    assert not running, running
    assert not list(Path(tempfile.gettempdir()).glob(f"omni-program-{os.getpid()}-*"))
    serves_next(runner)


def test_a_missing_program_fails_the_load(pids: Path) -> None:
    config = parse_config({"stage_args": [stage_config(pids, argv=["no-such-program-here", "{output}"])]})
    runner = ProgramRunner(config.stage_args[0])
    with pytest.raises(FileNotFoundError, match="no-such-program-here"):
        runner.load()


#: Text a shell would act on: quotes, expansions, separators, globs, redirections, newlines.
SHELLISH = st.text(
    alphabet=st.one_of(
        st.sampled_from(list("$`'\"\\;|&<>(){}[]*?~!#% \t\n=-")),
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    ),
    max_size=40,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arg=SHELLISH, prompt=SHELLISH)
def test_params_and_prompt_reach_the_program_verbatim_as_one_argument(pids: Path, arg: str, prompt: str) -> None:
    runner = runner_for(
        pids,
        argv=[sys.executable, "-I", HELPER, "ok", "{output}", "{arg}", "--opt={arg}", "{prompt}"],
        prompt="argv",
    )
    (out,) = run(runner, request(runner, "ok", prompt=prompt, arg=arg))
    assert out.error is None, out.error
    assert json.loads(out.text)["argv"] == [arg, f"--opt={arg}", prompt]


def test_through_an_engine_a_failure_is_typed_and_the_stage_serves_on(tmp_path: Path, pids: Path) -> None:
    stage = stage_config(pids, timeout_s=0.5)
    stage["runtime"] = {"backend": "process"}
    config = parse_config({"model": "hostile", "stage_args": [stage]})
    with Omni(model=config) as omni:
        hang, exited = omni.generate(["a", "b"], [{"mode": "hang"}, {"mode": "exit"}], use_tqdm=False)
        assert isinstance(hang.error, ProgramTimeoutError), hang.error
        assert isinstance(exited.error, ProgramError) and "boom" in str(exited.error)
        (good,) = omni.generate("fine", {"mode": "ok", "arg": "x"}, use_tqdm=False)
        assert good.error is None
        assert json.loads(good.text or "") == {"argv": ["x"], "stdin": "fine"}
    assert_nothing_left(pids)


def test_a_killed_stage_process_takes_its_program_with_it(pids: Path) -> None:
    """...and the request folder it could not remove goes when the replica that replaces it starts."""
    stage = stage_config(pids, timeout_s=60)
    stage["runtime"] = {"backend": "process", "max_restarts": 1}
    config = parse_config({"model": "hostile", "stage_args": [stage]})
    with Omni(model=config) as omni:
        result: dict[str, Any] = {}
        waiter = threading.Thread(
            target=lambda: result.update(out=omni.generate("x", {"mode": "sleep"}, use_tqdm=False)[0])
        )
        waiter.start()
        deadline = time.monotonic() + 10
        while not list(pids.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.02)
        (program,) = (int(p.name) for p in pids.iterdir())
        stage_process = psutil.Process(program).parent()
        assert stage_process is not None and stage_process.pid != os.getpid()
        os.kill(stage_process.pid, signal.SIGKILL)
        waiter.join(10)
        assert isinstance(result["out"].error, StageDeadError), result
        # The parent-death signal: the program goes with the stage process, at once.
        assert_nothing_left(pids)
        deadline = time.monotonic() + 15
        while True:  # the restarted replica serves
            (out,) = omni.generate("back", {"mode": "ok", "arg": "y"}, use_tqdm=False)
            if out.error is None or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert out.error is None and json.loads(out.text or "")["stdin"] == "back"
        # What the killed process could not remove, its successor did at its start.
        assert not list(Path(tempfile.gettempdir()).glob(f"omni-program-{stage_process.pid}-*"))
