"""The ``worker`` stage: a resident program spoken to in JSON lines, against a hostile worker
(``hostile_worker.py``) and the example a user copies (``examples/external_worker/worker.py``).

One program serves many requests (one pid); its progress lines become step progress; an error
line fails its request alone and the same program serves on. A program that dies mid-request, a
request past its timeout, an abort whose cancel goes unanswered, a line without end and an output
file past its bound each fail the requests in flight with a typed error, stop the program's whole
group, and the next request starts it again, after a backoff that doubles per death in a row. A
program that never says ready, or exits first, fails the stage's load. Through an engine, the
example serves, and an abort mid-request is answered by its cancel without a restart.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from omni_runtime import Omni
from omni_runtime.config import parse_config
from omni_runtime.exceptions import (
    ProgramError,
    ProgramTimeoutError,
    RequestAbortedError,
    RequestTimeoutError,
    StageAsleepError,
)
from omni_runtime.params import GenericSamplingParams, resolve_params
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.resident import ResidentRunner

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent
HOSTILE = str(HERE / "hostile_worker.py")
EXAMPLE = str(HERE.parents[3] / "examples" / "external_worker" / "worker.py")


def stage_config(pids: Path, argv: list[str] | None = None, **runner_args: Any) -> dict[str, Any]:
    args = {
        "argv": argv or [sys.executable, "-u", HOSTILE],
        "outputs": [{"name": "answer", "path": "answer.txt"}],
        "env": {"PIDS_DIR": str(pids)},
        "timeout_s": 5,
        "kill_grace_s": 0.3,
        "max_stdout_bytes": 1 << 16,
        "max_output_bytes": 1 << 20,
        "startup_timeout_s": 10,
        "restart_backoff_s": 0.05,
        **runner_args,
    }
    return {"stage_id": 0, "stage_type": "worker", "final_output": True, "final_output_type": "text",
            "runner_args": args}  # fmt: skip


@pytest.fixture
def pids(tmp_path: Path) -> Path:
    folder = tmp_path / "pids"
    folder.mkdir()
    return folder


def loaded(pids: Path, argv: list[str] | None = None, **runner_args: Any) -> ResidentRunner:
    runner = ResidentRunner(parse_config({"stage_args": [stage_config(pids, argv, **runner_args)]}).stage_args[0])
    runner.load()
    return runner


def req(mode: str = "ok", prompt: str = "hi", rid: str = "r", **params: Any) -> RunnerRequest:
    return RunnerRequest(
        request_id=rid, prompt=prompt, params=resolve_params(GenericSamplingParams, {}, {"mode": mode, **params})
    )


def run(runner: ResidentRunner, *reqs: RunnerRequest, aborted: Any = None, progress: Any = None) -> list[RunnerOutput]:
    return runner.execute(list(reqs), ExecuteContext(aborted or (lambda rid: False), progress=progress))


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def recorded(pids: Path) -> list[int]:
    return sorted(int(p.name) for p in pids.iterdir())


@pytest.fixture
def runner(pids: Path):
    runner = loaded(pids)
    yield runner
    runner._stop("the test is done")


def test_one_program_serves_many_requests_with_progress(runner: ResidentRunner, pids: Path) -> None:
    steps: list[tuple[list[str], int, int]] = []
    for i in range(3):
        (out,) = run(runner, req(prompt=f"hello {i}", rid=f"r{i}"), progress=lambda *a: steps.append(a))
        assert out.error is None and out.text == f"HELLO {i}"
    assert len(recorded(pids)) == 1 and runner.restarts == 0
    assert steps[:2] == [(["r0"], 1, 2), (["r0"], 2, 2)]


def test_an_error_line_fails_its_request_alone(runner: ResidentRunner, pids: Path) -> None:
    bad, good = run(runner, req("error", rid="a"), req(rid="b", prompt="fine"))
    assert isinstance(bad.error, ProgramError) and "bad input for this model" in str(bad.error)
    assert good.text == "FINE"
    assert runner.restarts == 0


@pytest.mark.parametrize(
    ("mode", "fields", "error", "says"),
    [
        ("die", {}, ProgramError, "exited with status 5 while this request was in flight: segfault in the model"),
        ("hang", {"timeout_s": 0.4}, ProgramTimeoutError, "ran past its timeout of 0.4 s"),
        ("flood", {}, ProgramError, f"a line past {1 << 16} bytes"),
        ("huge", {}, ProgramError, f"past {1 << 20} bytes"),
    ],
)
def test_a_broken_program_fails_its_request_is_stopped_and_comes_back(
    pids: Path, mode: str, fields: dict[str, Any], error: type, says: str
) -> None:
    runner = loaded(pids, **fields)
    try:
        (first,) = recorded(pids)
        started = time.monotonic()
        (out,) = run(runner, req(mode))
        assert type(out.error) is error and says in str(out.error), out.error
        assert time.monotonic() - started < 3
        assert gone(first) and runner.proc is None
        (back,) = run(runner, req(prompt="again"))
        assert back.text == "AGAIN" and runner.restarts == 1
        assert len(recorded(pids)) == 2
    finally:
        runner._stop("the test is done")


def test_a_program_that_closes_its_output_fails_at_once_without_spinning(pids: Path) -> None:
    """It can answer nothing more: its requests fail well before their timeout, and the wait for
    its exit does not spin the forward thread."""
    runner = loaded(pids, timeout_s=5)
    try:
        (first,) = recorded(pids)
        started, cpu = time.monotonic(), time.process_time()
        (out,) = run(runner, req("mute"))
        took, spent = time.monotonic() - started, time.process_time() - cpu
        assert type(out.error) is ProgramError and "closed its standard output" in str(out.error), out.error
        assert took < 3 and spent < took / 2, (took, spent)
        assert gone(first) and runner.proc is None
        (back,) = run(runner, req(prompt="again"))
        assert back.text == "AGAIN"
    finally:
        runner._stop("the test is done")


def test_a_request_that_cannot_be_sent_fails_alone_beside_one_already_sent(runner: ResidentRunner, pids: Path) -> None:
    """A prompt no protocol line can carry (a caller that skipped the engine's checks), after a
    request already sent: that one is answered, this one fails alone, nothing is sent twice and
    its folder is removed."""
    good, bad = run(runner, req(rid="a", prompt="fine"), req(rid="b", prompt="\ud800"))
    assert good.error is None and good.text == "FINE"
    assert type(bad.error) is ProgramError and "cannot be sent" in str(bad.error), bad.error
    assert runner.restarts == 0 and len(recorded(pids)) == 1
    assert not list(Path(tempfile.gettempdir()).glob(f"omni-worker-{os.getpid()}-*"))


def test_a_line_without_end_costs_its_length_not_its_square(pids: Path) -> None:
    """A 64 MiB line bound: a program that writes one line without end reaches it in well under
    a second (the partial line was copied and split again at every 64 KiB read: the timeout came
    first)."""
    runner = loaded(pids, max_stdout_bytes=1 << 26, timeout_s=10)
    try:
        started = time.monotonic()
        (out,) = run(runner, req("flood"))
        assert type(out.error) is ProgramError and f"a line past {1 << 26} bytes" in str(out.error), out.error
        assert time.monotonic() - started < 3
    finally:
        runner._stop("the test is done")


def test_an_unanswered_cancel_restarts_the_program(runner: ResidentRunner, pids: Path) -> None:
    calls = {"n": 0}

    def aborted(rid: str) -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    (out,) = run(runner, req("hang"), aborted=aborted)
    assert isinstance(out.error, RequestAbortedError)
    assert gone(recorded(pids)[0]) and runner.proc is None


def test_sleep_stops_the_program_and_wake_up_starts_it(runner: ResidentRunner, pids: Path) -> None:
    (first,) = recorded(pids)
    assert runner.sleep() == {"stopped_pid": first} and gone(first)
    (out,) = run(runner, req())
    assert isinstance(out.error, StageAsleepError)
    runner.wake_up()
    (out,) = run(runner, req(prompt="awake"))
    assert out.text == "AWAKE" and len(recorded(pids)) == 2


def test_restarts_back_off_doubling_per_death_in_a_row(pids: Path) -> None:
    runner = loaded(pids, restart_backoff_s=0.2)
    try:
        waits = []
        for _ in range(3):
            run(runner, req("die"))
            started = time.monotonic()
            run(runner, req("error"))  # the start waits for the backoff; the error is no success
            waits.append(time.monotonic() - started)
        assert waits[0] >= 0.2 and waits[1] >= 0.4 * 0.95 and waits[2] >= 0.8 * 0.95, waits
        (out,) = run(runner, req())
        assert out.text == "HI" and runner._deaths_in_row == 0  # an answer resets it
    finally:
        runner._stop("the test is done")


@pytest.mark.parametrize(
    ("start", "says"),
    [("silent", "did not say ready"), ("exit", "exited with status 7"), ("mute", "closed its standard output")],
)
def test_a_program_that_does_not_get_ready_fails_the_load(pids: Path, start: str, says: str) -> None:
    runner = ResidentRunner(
        parse_config(
            {"stage_args": [stage_config(pids, [sys.executable, HOSTILE, start], startup_timeout_s=0.5)]}
        ).stage_args[0]
    )
    with pytest.raises(ProgramError, match=says):
        runner.load()
    assert all(gone(pid) for pid in recorded(pids))


def test_the_example_worker_serves_and_answers_a_cancel_through_an_engine(pids: Path) -> None:
    stage = stage_config(pids, [sys.executable, "-u", EXAMPLE])
    stage["runtime"] = {"backend": "process"}
    config = parse_config({"model": "example", "stage_args": [stage]})
    with Omni(model=config) as omni:
        (out,) = omni.generate("hello world", {"steps": 2}, use_tqdm=False)
        assert out.error is None and out.text == "HELLO WORLD"
        started = time.monotonic()
        (slow,) = omni.generate("slow", {"steps": 50, "delay_ms": 100, "timeout": 0.5}, use_tqdm=False)
        assert isinstance(slow.error, RequestTimeoutError), slow.error
        (again,) = omni.generate("again", {"steps": 1}, use_tqdm=False)
        assert again.text == "AGAIN"
        assert time.monotonic() - started < 3  # the 5 s request stopped at its cancel
        stats = omni.collective_rpc("get_stats")
        assert stats[0].result["worker_restarts"] == 0  # the cancel was answered: no restart
