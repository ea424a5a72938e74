"""The ``subprocess`` stage: an external program run once per request.

Runs in the stage worker's forward thread. One ``execute()`` starts a process per request of the
wave (side by side; ``engine_args.max_num_seqs`` bounds how many), each in a folder of its own
and a process group of its own, from the stage's ``argv`` template
(:class:`~omni_runtime.external.ProgramArgs`): every placeholder's value is one argument, and no
shell runs. The prompt goes in as a file (on standard input, as ``{prompt_file}``, or as one
argument); the declared output files come back as media items (audio, image, video) or text.

Every run is bounded: ``timeout_s``, the standard output's and each output file's bytes; a run
that passes one, is aborted, or exits with an error is stopped as a group (SIGTERM, SIGKILL
after ``kill_grace_s``) and fails its request alone with a typed error
(:class:`~omni_runtime.exceptions.ProgramError`); its folder is removed, and the stage serves on.

Outputs: the items of its ``outputs`` in order, ``text`` from a text output or the standard
output (``stdout: text``); metrics ``batch_size``, ``execution_ms`` and ``audio_samples`` (speech).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from omni_runtime.config import StageConfig
from omni_runtime.exceptions import InvalidRequestError, ProgramError, ProgramTimeoutError, RequestAbortedError
from omni_runtime.external import (
    ProgramArgs,
    ProgramOutput,
    fill,
    program_args,
    program_params_class,
    speed_bounds,
)
from omni_runtime.media import AudioItem, ImageItem, MediaItem, VideoItem
from omni_runtime.messages import SpeechBound, StageConstraints
from omni_runtime.params import SpeechSamplingParams, params_to_dict
from omni_runtime.stage.program_run import Limits, ProgramRun, RunSet
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StageRunner

#: Most pixels of an image output, and of all of a video output's frames together.
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_VIDEO_BYTES = 1 << 30
#: Most bytes of an audio output's samples as decoded (float32, every channel): a compressed file
#: within ``max_output_bytes`` may decode to far more (silence in FLAC, about 4,000 times more).
MAX_AUDIO_BYTES = 1 << 30
#: How much of the standard error an error message quotes (its end).
STDERR_IN_ERROR = 800


class ProgramRunner(StageRunner):
    """An external program per request (see the module docstring)."""

    def __init__(self, stage: StageConfig) -> None:
        super().__init__(stage)
        self.args: ProgramArgs = self.decode_args(stage)
        # The params class follows runner_args (``params: speech``), as resolve chose it.
        self.params_cls = program_params_class(stage.runner_args)  # type: ignore[misc]
        self.limits = Limits(
            timeout_s=self.args.timeout_s,
            kill_grace_s=self.args.kill_grace_s,
            max_stdout_bytes=self.args.max_stdout_bytes,
            max_stderr_bytes=self.args.max_stderr_bytes,
            max_output_bytes=self.args.max_output_bytes,
        )
        self.env = {**os.environ, **self.args.env}
        self.executable = self.args.argv[0]
        self.name = Path(self.args.argv[0]).name
        #: A speech stage's length bound (set at load).
        self.bound: SpeechBound | None = None
        #: What the program is started through (util-linux's ``setpriv``, for its parent-death signal).
        self.prefix: list[str] = []

    def decode_args(self, stage: StageConfig) -> ProgramArgs:
        """The stage's ``runner_args`` (checked at load already)."""
        return program_args(stage.runner_args)

    def load(self) -> None:
        """Find the program (on the stage's ``PATH``), so that a missing one fails at start."""
        first = self.args.argv[0]
        if first == "{python}":
            assert self.args.python is not None  # checked at load
            found: str | None = self.args.python if os.access(self.args.python, os.X_OK) else None
            self.name = Path(self.args.python).name
        else:
            found = shutil.which(first, path=self.env.get("PATH"))
        if found is None:
            raise FileNotFoundError(
                f"runner_args.argv[0]: {first!r} is not an executable file on the stage's PATH "
                "(install the program, or give its absolute path)"
            )
        self.executable = found
        # The program dies with the thread that started it (this stage's forward thread, which
        # lives as long as the stage): a stage process that is killed leaves no program running.
        setpriv = shutil.which("setpriv")
        self.prefix = [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []
        self.bound = self._bound()
        remove_stale_folders()

    def _bound(self) -> SpeechBound | None:
        if self.args.params != "speech" or self.args.seconds_per_char is None:
            return None
        return SpeechBound(
            max_seconds=self.stage.engine_args.max_speech_seconds,
            token_frames=max(int(np.ceil(self.args.seconds_per_char * 1000)), 1),
            frame_s=0.001,
            tokens_per_char=1,
            speeds=speed_bounds(self.args),
        )

    def constraints(self) -> StageConstraints:
        if self.args.params != "speech":
            return StageConstraints()
        return StageConstraints(voices=tuple(self.args.voices), speech=self.bound)

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        started = time.perf_counter()
        outputs: list[RunnerOutput | None] = [None] * len(batch)
        folders: dict[int, Path] = {}
        runs = RunSet()
        try:
            # 1) a folder, a command and a process per request (a refused one fails alone)
            try:
                for i, req in enumerate(batch):
                    if ctx.is_aborted(req.request_id):
                        outputs[i] = RunnerOutput(error=RequestAbortedError("aborted"))
                        continue
                    folders[i] = request_folder("omni-program")
                    try:
                        runs.add(str(i), self._start(req, folders[i]))
                    except (InvalidRequestError, ProgramError) as e:
                        outputs[i] = RunnerOutput(error=e)
            except BaseException:
                # Anything else (a prompt file that cannot be written): the wave fails and is run
                # again one by one, so the programs already started are stopped, not left running.
                runs.wait(lambda key: True)
                raise
            # 2) every run to its end (stopped as a group on a limit or an abort)
            finished = runs.wait(lambda key: ctx.is_aborted(batch[int(key)].request_id))
            # 3) each run's files read back
            elapsed_ms = (time.perf_counter() - started) * 1000
            for key, run in finished.items():
                i = int(key)
                outputs[i] = self._result(batch[i], run, folders[i], len(batch), elapsed_ms)
        finally:
            for folder in folders.values():
                shutil.rmtree(folder, ignore_errors=True)
        return [o if o is not None else RunnerOutput(error=ProgramError("no result")) for o in outputs]

    # ------------------------------------------------------------------ one request

    def _text_prompt(self, req: RunnerRequest) -> str:
        """The request's text (its prompt, or an upstream stage's ``text``), its length checked."""
        prompt = req.prompt if isinstance(req.prompt, str) else req.inputs.get("text")
        if not isinstance(prompt, str):
            raise InvalidRequestError(
                f"a {self.stage.stage_type} stage takes a text prompt, got {type(req.prompt).__name__}",
                param="prompt",
            )
        self._check_length(prompt, req.params)
        return prompt

    def _start(self, req: RunnerRequest, folder: Path) -> ProgramRun:
        prompt = self._text_prompt(req)
        prompt_file = folder / "prompt.txt"
        prompt_file.write_text(prompt, encoding="utf-8", errors="surrogateescape")
        values = self._values(req, prompt, folder, prompt_file)
        argv = [fill(t, values) for t in self.args.argv]
        argv[0] = self.executable  # as found at load (a {python} first is the interpreter itself)
        try:
            return ProgramRun(
                [*self.prefix, *argv],
                cwd=self.args.cwd or str(folder),
                env=self.env,
                stdin=prompt_file if self.args.prompt == "stdin" else None,
                limits=self.limits,
                watch=[folder / self.args.output_path(o) for o in self.args.outputs],
            )
        except OSError as e:
            if e.errno == errno.E2BIG:  # the request's values, not the stage: a 400, not a 500
                raise InvalidRequestError(
                    f"the arguments of {self.name} would be too long for the system (at most 128 KiB each, "
                    "and ARG_MAX together): shorten the prompt or the params that go into its argv"
                ) from None
            raise ProgramError(f"{self.name} could not start: {e}") from None

    def _check_length(self, prompt: str, params: Any) -> None:
        """A caller that skipped the engine's check still meets the speech bound."""
        bound = self.bound
        if bound is None:
            return
        speed = float(params.speed or 1.0)
        if bound.speeds is not None and not bound.speeds[0] <= speed <= bound.speeds[1]:
            raise InvalidRequestError(f"invalid sampling param `speed`: {speed:g} is out of range", param="speed")
        if bound.longest_s(len(prompt), speed) > bound.max_seconds:
            raise InvalidRequestError(
                f"invalid sampling param `prompt`: {len(prompt)} characters could speak past "
                f"{bound.max_seconds:g} s (engine_args.max_speech_seconds); split the text",
                param="prompt",
            )

    def _values(self, req: RunnerRequest, prompt: str, folder: Path, prompt_file: Path) -> dict[str, str]:
        """Every placeholder's value: the runner's own, the outputs' paths, the request's params."""
        values = {"workdir": str(folder), "prompt_file": str(prompt_file), "request_id": req.request_id}
        if self.args.python is not None:
            values["python"] = self.args.python
        if self.args.prompt == "argv":
            values["prompt"] = _argument(prompt, "prompt")
        for output in self.args.outputs:
            values[output.name] = str(folder / self.args.output_path(output))
        given = params_to_dict(req.params)
        if isinstance(req.params, SpeechSamplingParams):
            given.update(self._speech_values(req.params))
        for name in self.args.param_names():
            if name in values:
                continue
            value = given.get(name)
            if value is None:
                raise InvalidRequestError(
                    f"invalid sampling param `{name}`: the stage's program takes it (argv), and the request "
                    "sets none (nor do the stage's default_sampling_params)",
                    param=name,
                )
            values[name] = _argument(value, name)
        return values

    def _speech_values(self, params: SpeechSamplingParams) -> dict[str, Any]:
        out: dict[str, Any] = {}
        voices = self.args.voices
        voice = params.voice if params.voice is not None else next(iter(voices), None)
        if voices and voice is not None:
            if voice not in voices:  # a caller that skipped the constraints check (READY lists them)
                raise InvalidRequestError(
                    f"invalid sampling param `voice`: unknown voice {voice[:64]!r}", param="voice"
                )
            out["voice"] = voices[voice]
        elif voice is not None:
            out["voice"] = voice
        speed = float(params.speed or 1.0)
        if self.args.speed is not None:
            value = round(self.args.speed.scale * speed)
            if not self.args.speed.min <= value <= self.args.speed.max:
                raise InvalidRequestError(f"invalid sampling param `speed`: {speed:g} is out of range", param="speed")
            out[self.args.speed.placeholder] = value
        return out

    def _result(self, req: RunnerRequest, run: ProgramRun, folder: Path, size: int, elapsed_ms: float) -> RunnerOutput:
        # 1) how the run ended
        if run.failure == "cancelled":
            return RunnerOutput(error=RequestAbortedError("aborted"))
        if run.timed_out:
            return RunnerOutput(error=ProgramTimeoutError(f"{self.name} {run.failure}; it was stopped"))
        if run.failure is not None:
            return RunnerOutput(error=ProgramError(f"{self.name} {run.failure}; it was stopped{_said(run)}"))
        code = run.returncode
        if code:
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
            return RunnerOutput(error=ProgramError(f"{self.name} {how}{_said(run)}"))
        # 2) its outputs read back
        metrics: dict[str, float | int] = {"batch_size": size, "execution_ms": elapsed_ms}
        media: list[MediaItem] = []
        texts: list[str] = []
        try:
            if self.args.stdout == "text":
                texts.append(_text(run.stdout, "its standard output"))
            for output in self.args.outputs:
                item = self._read(output, folder)
                if isinstance(item, str):
                    texts.append(item)
                else:
                    media.append(item)
                    if isinstance(item, AudioItem):
                        metrics["audio_samples"] = item.num_samples
        except ProgramError as e:
            return RunnerOutput(error=e)
        return RunnerOutput(text="\n".join(texts) if texts else None, media=media, metrics=metrics)

    def _read(self, output: ProgramOutput, folder: Path) -> MediaItem | str:
        rel = self.args.output_path(output)
        path = folder / rel
        try:
            info = path.lstat()
        except OSError:
            raise ProgramError(f"{self.name} exited without writing {rel}") from None
        if not path.is_file() or path.is_symlink():
            raise ProgramError(f"{self.name}'s {rel} is not a regular file (a link is not followed)")
        if info.st_size > self.args.max_output_bytes:
            raise ProgramError(f"{self.name}'s {rel} is {info.st_size} bytes, past {self.args.max_output_bytes}")
        kind = self.args.output_kind(output)
        try:
            if kind == "audio":
                return self._audio(path)
            if kind == "image":
                return _image(path)
            if kind == "video":
                return _video(path)
            return _text(path.read_bytes(), rel)
        except ProgramError:
            raise
        except Exception as e:  # a decoder's own error: the file is not what it should be
            raise ProgramError(f"{self.name}'s {rel} is not a readable {kind} file: {type(e).__name__}: {e}") from None

    def _audio(self, path: Path) -> AudioItem:
        import soundfile

        info = soundfile.info(str(path))
        decoded = info.frames * info.channels * 4
        if decoded > MAX_AUDIO_BYTES:
            raise ProgramError(
                f"{self.name}'s {path.name} decodes to {decoded} bytes of samples, past {MAX_AUDIO_BYTES}"
            )
        bound = self.bound
        if bound is not None and info.frames > bound.max_seconds * info.samplerate:
            raise ProgramError(
                f"{self.name}'s {path.name} is {info.frames / info.samplerate:.0f} s long, past the "
                f"{bound.max_seconds:g} s of engine_args.max_speech_seconds"
            )
        data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
        if data.shape[0] == 0:
            raise ProgramError(f"{self.name}'s {path.name} holds no samples")
        return AudioItem(data=np.ascontiguousarray(data.T), sample_rate=int(rate))


def request_folder(kind: str) -> Path:
    """A new folder for one request, named for this process (``<kind>-<pid>-...``), so that what a
    killed stage process left is known as such (:func:`remove_stale_folders`)."""
    return Path(tempfile.mkdtemp(prefix=f"{kind}-{os.getpid()}-"))


def remove_stale_folders() -> None:
    """Remove the request folders of stage processes that are gone (killed mid-request: no
    ``finally`` of theirs ran)."""
    for path in Path(tempfile.gettempdir()).glob("omni-*-*-*"):
        kind, _, rest = path.name.partition("-")[2].partition("-")
        pid = rest.partition("-")[0]
        if kind not in ("program", "worker") or not pid.isdigit() or not path.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue


def _argument(value: Any, name: str) -> str:
    """A param's value as one argument: text as it is, a number or a bool as written."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int | float | str):
        text = str(value)
    else:
        raise InvalidRequestError(
            f"invalid sampling param `{name}`: a program argument is a string, number or bool, "
            f"got {type(value).__name__}",
            param=name,
        )
    if "\x00" in text:
        raise InvalidRequestError(f"invalid sampling param `{name}`: contains a NUL character", param=name)
    return text


def _said(run: ProgramRun) -> str:
    tail = run.stderr_tail
    return f": {tail[-STDERR_IN_ERROR:]}" if tail else ""


def _text(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ProgramError(f"{what} is not UTF-8 text: {e}") from None


def _image(path: Path) -> ImageItem:
    from PIL import Image

    with Image.open(path) as image:
        w, h = image.size
        if w * h > MAX_IMAGE_PIXELS:
            raise ProgramError(f"{path.name} is {w}x{h}, past {MAX_IMAGE_PIXELS} pixels")
        return ImageItem(data=np.asarray(image.convert("RGB"), dtype=np.uint8).copy())


def _video(path: Path) -> VideoItem:
    import av

    frames: list[np.ndarray] = []
    total = 0
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        fps = round(float(stream.average_rate or 24))
        for frame in container.decode(stream):
            array = frame.to_ndarray(format="rgb24")
            total += array.nbytes
            if total > MAX_VIDEO_BYTES:
                raise ProgramError(f"{path.name} decodes past {MAX_VIDEO_BYTES} bytes of frames")
            frames.append(array)
    if not frames:
        raise ProgramError(f"{path.name} holds no frames")
    return VideoItem(data=np.stack(frames), fps=max(fps, 1))
