"""The ``worker`` stage: an external program started once per replica, kept resident, and sent
its requests as JSON lines (the protocol: :mod:`omni_runtime.external`, docs/configuration.md
"External programs").

Runs in the stage worker's forward thread, like every runner. ``load`` starts the program and
waits for its ``ready`` line (``startup_timeout_s``): a program that never says it fails the
stage's start. ``execute`` sends each request of the wave (its prompt, params, own folder and
output paths), forwards its ``progress`` lines as step progress, and reads its declared files
back when it says ``output``, as the ``subprocess`` stage does.

What ends the resident program: it exits (every request it held fails with
:class:`~omni_runtime.exceptions.ProgramError`, naming its exit and its standard error's end), a
request passes ``timeout_s`` (that one fails with ProgramTimeoutError), an aborted request is
not answered within ``kill_grace_s`` of its ``cancel``, an output file passes
``max_output_bytes``, or a line breaks the protocol. Its process group is then stopped (SIGTERM,
SIGKILL after ``kill_grace_s``), and the next wave starts it again once its backoff has passed
(``restart_backoff_s``, doubled per death in a row, at most ``max_restart_backoff_s``; a request
answered resets it). The program dies with the stage (util-linux's ``setpriv --pdeathsig``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from omni_runtime.config import StageConfig
from omni_runtime.exceptions import (
    InvalidRequestError,
    ProgramError,
    ProgramTimeoutError,
    RequestAbortedError,
    StageAsleepError,
)
from omni_runtime.external import (
    Cancel,
    Error,
    Output,
    ProgramArgs,
    Progress,
    Ready,
    Request,
    WorkerArgs,
    WorkerMessage,
    fill,
    worker_args,
)
from omni_runtime.params import SpeechSamplingParams, params_to_dict
from omni_runtime.stage.resident_process import ResidentProcess
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest
from omni_runtime.stage.runners.program import ProgramRunner, request_folder

logger = logging.getLogger(__name__)

#: Seconds between two looks at the requests in flight (aborts, timeouts, files).
TICK_S = 0.05
#: Seconds a program whose standard output closed has to exit (its exit status is the better
#: reason) before it is taken as broken: it can answer nothing more.
OUTPUT_LINGER_S = 0.5
_DECODER = msgspec.json.Decoder(WorkerMessage)
_ENCODER = msgspec.json.Encoder()


@dataclass
class _InFlight:
    index: int
    request: RunnerRequest
    folder: Path
    sent_at: float
    cancelled_at: float | None = None


class ResidentRunner(ProgramRunner):
    """A resident external program (see the module docstring)."""

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        assert isinstance(self.args, WorkerArgs)  # decode_args below
        self.worker: WorkerArgs = self.args
        self.proc: ResidentProcess | None = None
        self.restarts = 0
        self.asleep = False
        self._deaths_in_row = 0
        self._died_at = 0.0

    def decode_args(self, stage: StageConfig) -> ProgramArgs:
        return worker_args(stage.runner_args)

    def load(self) -> None:
        super().load()
        ready = self._launch()
        # The program says how many requests it takes at once; the stage's waves are capped at it.
        self.max_batch_size = ready.max_batch

    def stats(self) -> dict[str, Any]:
        return {"worker_restarts": self.restarts, "worker_pid": self.proc.pid if self.proc is not None else 0}

    # ------------------------------------------------------------------ the resident program

    def sleep(self) -> dict[str, Any]:
        """Stop the program (its memory is its own: this is how it is released); requests fail
        with StageAsleepError until ``wake_up``."""
        pid = self.proc.pid if self.proc is not None else None
        if self.proc is not None:
            self.proc.stop(self.args.kill_grace_s)
            self.proc = None
        self.asleep = True
        return {"stopped_pid": pid}

    def wake_up(self) -> dict[str, Any]:
        """Start the program again (and wait for its ``ready``)."""
        self.asleep = False
        self._deaths_in_row = 0
        if self.proc is None:
            self._launch()
        return {"pid": self.proc.pid if self.proc is not None else None}

    def _launch(self, tick: Callable[[], object] | None = None) -> Ready:
        """Start the program and wait for its ``ready`` line; ProgramError if it does not come.
        ``tick`` is called at every look (a wave's liveness: the stage's stall clock)."""
        values = {"python": self.args.python} if self.args.python is not None else {}
        argv = [fill(t, values) for t in self.args.argv]
        argv[0] = self.executable
        folder = self.args.cwd or os.getcwd()  # unset: where the stage runs (a relative argv works)
        try:
            proc = ResidentProcess(
                [*self.prefix, *argv],
                cwd=folder,
                env=self.env,
                max_line_bytes=self.args.max_stdout_bytes,
                max_stderr_bytes=self.args.max_stderr_bytes,
            )
        except OSError as e:
            raise ProgramError(f"{self.name} could not start: {e}") from None
        deadline = time.monotonic() + self.worker.startup_timeout_s
        while time.monotonic() < deadline:
            for line in proc.poll(TICK_S):
                message = _decode(line)
                if isinstance(message, Ready):
                    self.proc = proc
                    return message
            if tick is not None:
                tick()
            if _broken(proc) is not None:
                break
        why = _broken(proc) or "did not say ready in time"
        proc.stop(self.args.kill_grace_s)
        tail = proc.stderr_tail
        raise ProgramError(f"{self.name} {why} (startup_timeout_s {self.worker.startup_timeout_s:g})" + _said(tail))

    def _stop(self, why: str) -> None:
        """Stop the program (its whole group); the next wave starts it again after the backoff."""
        if self.proc is not None:
            logger.warning("stage %d: stopping its worker program (%s)", self.stage.stage_id, why)
            self.proc.stop(self.args.kill_grace_s)
            self.proc = None
        self._deaths_in_row += 1
        self._died_at = time.monotonic()

    def _backoff_left(self) -> float:
        if not self._deaths_in_row:
            return 0.0
        delay = min(self.worker.restart_backoff_s * 2 ** (self._deaths_in_row - 1), self.worker.max_restart_backoff_s)
        return max(self._died_at + delay - time.monotonic(), 0.0)

    def _ensure_started(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> None:
        if self.proc is not None:
            return
        # 1) the backoff, waited in slices so that aborts are seen
        while (left := self._backoff_left()) > 0:
            if all(ctx.is_aborted(r.request_id) for r in batch):
                return
            time.sleep(min(left, TICK_S))
        # 2) start it again
        try:
            self._launch(tick=lambda: ctx.is_aborted(batch[0].request_id))
        except ProgramError:
            self._stop("it did not start")
            raise
        self.restarts += 1

    # ------------------------------------------------------------------ a wave

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        started = time.perf_counter()
        outputs: list[RunnerOutput | None] = [None] * len(batch)
        if self.asleep:
            return [RunnerOutput(error=StageAsleepError("the worker stage is asleep")) for _ in batch]
        try:
            self._ensure_started(batch, ctx)
        except ProgramError as e:
            return [RunnerOutput(error=e) for _ in batch]
        flight: dict[str, _InFlight] = {}
        try:
            # 1) send every request (one refused fails alone)
            for i, req in enumerate(batch):
                if ctx.is_aborted(req.request_id) or self.proc is None:
                    outputs[i] = RunnerOutput(error=RequestAbortedError("aborted"))
                    continue
                folder = request_folder("omni-worker")
                try:
                    line = self._request_line(req, folder)
                except Exception as e:
                    # Failed alone (raising would leave the requests already sent to the program
                    # running, to be sent again under the same ids by the one-by-one retry).
                    shutil.rmtree(folder, ignore_errors=True)
                    if not isinstance(e, InvalidRequestError):
                        e = ProgramError(f"{self.name}: this request cannot be sent: {type(e).__name__}: {e}")
                    outputs[i] = RunnerOutput(error=e)
                    continue
                flight[req.request_id] = _InFlight(i, req, folder, time.monotonic())
                self.proc.send(line)
            # 2) answers until none is left in flight
            while flight:
                self._wait(flight, outputs, ctx, len(batch), started)
        finally:
            for item in flight.values():
                shutil.rmtree(item.folder, ignore_errors=True)
        return [o if o is not None else RunnerOutput(error=ProgramError("no result")) for o in outputs]

    def _request_line(self, req: RunnerRequest, folder: Path) -> bytes:
        prompt = self._text_prompt(req)
        params = params_to_dict(req.params)
        if isinstance(req.params, SpeechSamplingParams):
            params.update(self._speech_values(req.params))
        outputs = {o.name: str(folder / self.args.output_path(o)) for o in self.args.outputs}
        message = Request(id=req.request_id, prompt=prompt, params=params, workdir=str(folder), outputs=outputs)
        return _ENCODER.encode(message) + b"\n"

    def _wait(
        self,
        flight: dict[str, _InFlight],
        outputs: list[RunnerOutput | None],
        ctx: ExecuteContext,
        size: int,
        started: float,
    ) -> None:
        """One look: the lines the program wrote, then aborts, timeouts, files and its health."""
        proc = self.proc
        assert proc is not None
        # 1) its answers
        for line in proc.poll(TICK_S):
            message = _decode(line)
            item = flight.get(getattr(message, "id", ""))
            if item is None:
                continue  # a log line, ready again, or an id no longer in flight
            if isinstance(message, Progress):
                ctx.step_progress([item.request.request_id], message.step, message.steps)
                continue
            del flight[item.request.request_id]
            if isinstance(message, Output):
                outputs[item.index] = self._answer(item, message, size, started)
            elif isinstance(message, Error):
                failed: Exception = (
                    RequestAbortedError("aborted")
                    if item.cancelled_at is not None
                    else ProgramError(f"{self.name}: {message.message[:2000]}")
                )
                outputs[item.index] = RunnerOutput(error=failed)
            shutil.rmtree(item.folder, ignore_errors=True)
        # 2) aborts (a cancel line, then a grace), timeouts and output sizes
        now = time.monotonic()
        fatal: tuple[str, str, type[ProgramError] | None] | None = None  # (request, why, error type)
        for rid, item in flight.items():
            if item.cancelled_at is None and ctx.is_aborted(rid):
                item.cancelled_at = now
                proc.send(_ENCODER.encode(Cancel(id=rid)) + b"\n")
            elif item.cancelled_at is not None and now - item.cancelled_at > self.args.kill_grace_s:
                fatal = (rid, "did not answer a cancel", None)
            elif now - item.sent_at > self.args.timeout_s:
                fatal = (rid, f"ran past its timeout of {self.args.timeout_s:g} s", ProgramTimeoutError)
            elif (big := self._oversized(item)) is not None:
                fatal = (rid, f"wrote {big} past {self.args.max_output_bytes} bytes", ProgramError)
            if fatal is not None:
                break
        # 3) a program that died, broke the protocol or overran: every request in flight fails
        if fatal is None and (how := _broken(proc)) is not None:
            fatal = ("", how, ProgramError)
        if fatal is None:
            return
        rid, why, kind = fatal
        tail = proc.stderr_tail
        self._stop(why)
        for other, item in list(flight.items()):
            if item.cancelled_at is not None:
                error: Exception = RequestAbortedError("aborted")
            elif other == rid and kind is not None:
                error = kind(f"{self.name} {why}; it was stopped" + _said(tail))
            else:
                error = ProgramError(f"{self.name} {why} while this request was in flight" + _said(tail))
            outputs[item.index] = RunnerOutput(error=error)
            shutil.rmtree(item.folder, ignore_errors=True)
            del flight[other]

    def _oversized(self, item: _InFlight) -> str | None:
        for output in self.args.outputs:
            path = item.folder / self.args.output_path(output)
            try:
                if path.lstat().st_size > self.args.max_output_bytes:
                    return path.name
            except OSError:
                continue
        return None

    def _answer(self, item: _InFlight, message: Output, size: int, started: float) -> RunnerOutput:
        media = []
        metrics: dict[str, float | int] = {"batch_size": size, "execution_ms": (time.perf_counter() - started) * 1000}
        try:
            for output in self.args.outputs:
                found = self._read(output, item.folder)
                if isinstance(found, str):
                    message = msgspec.structs.replace(message, text="\n".join(filter(None, (message.text, found))))
                else:
                    media.append(found)
        except ProgramError as e:
            return RunnerOutput(error=e)
        self._deaths_in_row = 0
        return RunnerOutput(text=message.text, media=media, metrics=metrics)


def _decode(line: bytes) -> WorkerMessage | None:
    """A protocol line, or None for anything else the program printed (logged, not fatal)."""
    try:
        return _DECODER.decode(line)
    except (msgspec.DecodeError, msgspec.ValidationError):
        if line.strip():
            logger.debug("worker program wrote a line that is not the protocol: %r", line[:200])
        return None


def _broken(proc: ResidentProcess) -> str | None:
    """Why ``proc`` can serve no more (its protocol broken, it exited, its standard output
    closed), or None."""
    if proc.failure is not None:
        return proc.failure
    if proc.returncode is not None:
        return _exit(proc.returncode)
    closed = proc.output_closed_at
    if closed is not None and time.monotonic() - closed > OUTPUT_LINGER_S:
        return "closed its standard output"
    return None


def _exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _said(tail: str) -> str:
    return f": {tail[-800:]}" if tail else ""
