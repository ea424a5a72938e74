"""External programs as stages: the ``runner_args`` of a ``stage_type: subprocess`` or ``worker``
stage, decoded and checked once at load (:func:`program_args`), the params class its requests
take (:func:`program_params_class`), and the JSON-lines protocol a resident worker speaks
(:data:`WorkerMessage`, :data:`RuntimeMessage`).

A subprocess stage runs one command per request (the runner is
:class:`omni_runtime.stage.runners.program.ProgramRunner`); a worker stage starts its program once
per replica and sends it requests as JSON lines
(:class:`omni_runtime.stage.runners.resident.ResidentRunner`). Its command is an ``argv`` list of
templates: each element may hold ``{name}`` placeholders, filled per request from the request's
params and from what the runner provides (:data:`RUNNER_PLACEHOLDERS`, the outputs' names), and
each element stays one argument whatever a value holds: no shell ever sees it.

Imports no runner (the caller's side resolves a config with it).
"""

from __future__ import annotations

import os
import re
import string
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from omni_runtime.exceptions import ConfigError
from omni_runtime.params import GenericSamplingParams, SpeechSamplingParams

_Struct = {"kw_only": True, "forbid_unknown_fields": True, "frozen": True}

#: What the runner fills in itself: the request's own folder (removed after the request), the
#: file holding the prompt (UTF-8), the prompt itself (``prompt: argv`` only), the interpreter of
#: ``python:``, and the request's id. Each output's ``name`` is a placeholder too (its path).
RUNNER_PLACEHOLDERS = ("workdir", "prompt_file", "prompt", "python", "request_id")
#: The file suffixes an output's kind is read from when it declares none.
KIND_OF_SUFFIX = {
    ".wav": "audio",
    ".flac": "audio",
    ".ogg": "audio",
    ".png": "image",
    ".jpg": "image",
    ".jpeg": "image",
    ".webp": "image",
    ".mp4": "video",
    ".txt": "text",
}
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: What a worker stage's ``argv`` may name: it is started once, before any request.
WORKER_PLACEHOLDERS = ("python",)


class ProgramOutput(msgspec.Struct, **_Struct):
    """One file the program writes in the request's folder, read back as a media item."""

    #: The placeholder its absolute path is given by (``{output}``).
    name: str = "output"
    #: Where the program writes it, relative to the request's folder (it cannot name a place
    #: outside it). Unset: ``<name>`` and the kind's usual suffix (``output.wav``).
    path: str | None = None
    #: What it is read as: ``audio`` (WAV, FLAC, Ogg), ``image`` (PNG, JPEG, WebP), ``video`` (MP4),
    #: ``text`` (UTF-8). Unset: from the path's suffix.
    kind: Literal["audio", "image", "video", "text"] | None = None


#: The largest ``speed`` map value: a rate past it is a mistake, and ``scale x speed`` stays a
#: number ``round`` takes (an infinite one made every request fail).
MAX_RATE = 1e9
Rate = Annotated[float, msgspec.Meta(gt=0, le=MAX_RATE)]


class SpeedMap(msgspec.Struct, **_Struct):
    """How a speech request's ``speed`` (1.0 = the program's usual rate) reaches the program: as the
    placeholder ``placeholder``, ``round(scale x speed)``, within ``[min, max]`` (a speed outside is
    refused before it is queued)."""

    placeholder: str
    scale: Rate
    min: Rate
    max: Rate


class ProgramArgs(msgspec.Struct, **_Struct):
    """``runner_args`` of a ``stage_type: subprocess`` stage (docs/configuration.md, "External
    programs")."""

    #: The command, one template per argument; ``argv[0]`` is looked up on ``PATH`` (or is
    #: ``{python}``). Never run through a shell.
    argv: Annotated[list[str], msgspec.Meta(min_length=1)]
    #: Which request params the stage takes: ``generic`` (any fields, each a placeholder) or
    #: ``speech`` (``voice``, ``speed``, ``seed``: the stage serves text to speech).
    params: Literal["generic", "speech"] = "generic"
    #: How the prompt reaches the program: on its standard input, only as ``{prompt_file}``, as the
    #: placeholder ``{prompt}`` (one argument), or not at all. ``{prompt_file}`` is there always.
    prompt: Literal["stdin", "file", "argv", "none"] = "stdin"
    #: The files read back, in order, as the request's media.
    outputs: list[ProgramOutput] = msgspec.field(default_factory=list)
    #: ``text``: the standard output is the request's text (bounded by ``max_stdout_bytes``).
    stdout: Literal["ignore", "text"] = "ignore"
    #: Another virtualenv's interpreter (an absolute path), the placeholder ``{python}``.
    python: str | None = None
    #: Environment variables set over the stage process's own.
    env: dict[str, str] = msgspec.field(default_factory=dict)
    #: Working directory (absolute); unset: the request's own folder (a worker's: the stage's own).
    cwd: str | None = None
    #: Seconds one run may take; then its process group is killed and the request fails.
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)] = 60.0
    #: Seconds between SIGTERM and SIGKILL when a run is stopped (abort, timeout, a limit).
    kill_grace_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 2.0
    #: Most bytes kept of the standard output; more fails the request (the group is killed).
    max_stdout_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 1 << 20
    #: Most bytes kept of the standard error (for the error message); the rest is read and dropped.
    max_stderr_bytes: Annotated[int, msgspec.Meta(ge=0, le=1 << 24)] = 64 << 10
    #: Most bytes of one output file; a file that grows past it fails the request.
    max_output_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 34)] = 256 << 20
    #: Speech (``params: speech``): request voice -> the ``{voice}`` value; the first is the default.
    #: Any other voice is refused before it is queued.
    voices: dict[str, str] = msgspec.field(default_factory=dict)
    #: Speech: how ``speed`` reaches the program (unset: ``{speed}`` as the request gives it).
    speed: SpeedMap | None = None
    #: Speech: the most seconds one character of text may make at speed 1, the estimate a request
    #: is checked with against ``engine_args.max_speech_seconds`` before it is queued.
    seconds_per_char: Annotated[float, msgspec.Meta(gt=0, le=60)] | None = None

    def output_path(self, output: ProgramOutput) -> str:
        """``output``'s path relative to the request's folder."""
        if output.path is not None:
            return output.path
        suffix = {"audio": ".wav", "image": ".png", "video": ".mp4", "text": ".txt"}[output.kind or "text"]
        return output.name + suffix

    def output_kind(self, output: ProgramOutput) -> str:
        """``output``'s kind, declared or from its suffix (checked at load)."""
        return output.kind or KIND_OF_SUFFIX[os.path.splitext(self.output_path(output))[1].lower()]

    def param_names(self) -> tuple[str, ...]:
        """The placeholders that come from the request's params."""
        runner = {*RUNNER_PLACEHOLDERS, *(o.name for o in self.outputs)}
        return tuple(n for n in dict.fromkeys(name for t in self.argv for name in placeholders(t)) if n not in runner)


class WorkerArgs(ProgramArgs, **_Struct):
    """``runner_args`` of a ``stage_type: worker`` stage: a :class:`ProgramArgs` whose program is
    started once per replica and answers requests over the protocol below (its ``argv`` takes only
    ``{python}``; ``prompt`` and ``stdout`` do not apply: both travel in the protocol;
    ``max_stdout_bytes`` bounds one protocol line; ``timeout_s`` is per request)."""

    #: Seconds the program may take to say ``ready`` (at the stage's start, and after a restart).
    startup_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 120.0
    #: Seconds before the first restart of a program that died; doubled per death in a row, at
    #: most ``max_restart_backoff_s``; a request answered resets it.
    restart_backoff_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 0.5
    max_restart_backoff_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 30.0


_A = TypeVar("_A", bound=ProgramArgs)

# --------------------------------------------------------------------------- the worker protocol
# One JSON object per line, each with its ``type``: the program reads requests and cancels on its
# standard input and writes ready, progress, output and error on its standard output (its logs go
# to standard error). docs/configuration.md, "External programs", describes each.

_Line = {"kw_only": True, "frozen": True, "tag_field": "type"}


class Ready(msgspec.Struct, tag="ready", **_Line):
    """The program is loaded and takes requests: its first line."""

    #: Most requests it takes at once (the stage's waves are capped at it); 1: one at a time.
    max_batch: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1


class Progress(msgspec.Struct, tag="progress", **_Line):
    id: str
    step: Annotated[int, msgspec.Meta(ge=0)]
    steps: Annotated[int, msgspec.Meta(ge=1)]


class Output(msgspec.Struct, tag="output", **_Line):
    """The request is done: its declared output files are written; ``text`` is its text, if any."""

    id: str
    text: str | None = None


class Error(msgspec.Struct, tag="error", **_Line):
    """The request failed (the program serves on)."""

    id: str
    message: str


#: What the program writes.
WorkerMessage = Ready | Progress | Output | Error


class Request(msgspec.Struct, tag="request", **_Line):
    id: str
    prompt: str
    #: The request's params that are set (for a speech stage: ``voice`` as its ``voices`` maps it,
    #: and the ``speed`` placeholder's value too).
    params: dict[str, Any]
    #: The request's own folder, removed once it is answered.
    workdir: str
    #: Each declared output's name -> the absolute path to write it at.
    outputs: dict[str, str]


class Cancel(msgspec.Struct, tag="cancel", **_Line):
    """Stop ``id`` (aborted): answer it with an error, soon, or the program is restarted."""

    id: str


#: What the runtime writes.
RuntimeMessage = Request | Cancel


def placeholders(template: str) -> list[str]:
    """The ``{name}`` placeholders of one argv template; ValueError for anything but plain names
    (no ``{a.b}``, ``{a[0]}``, conversion or format spec: a value goes in as it is)."""
    names = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if not _NAME_RE.match(name) or spec or conversion:
            raise ValueError(f"{template!r}: a placeholder is a plain {{name}}, got {{{name}{spec and ':'}{spec}}}")
        names.append(name)
    return names


def fill(template: str, values: Mapping[str, str]) -> str:
    """One argv template with its placeholders replaced (``{{`` and ``}}`` are literal braces)."""
    return "".join(
        literal + ("" if name is None else values[name]) for literal, name, _, _ in string.Formatter().parse(template)
    )


def program_params_class(runner_args: Mapping[str, Any]) -> type[msgspec.Struct]:
    """The params class of a subprocess stage with these ``runner_args``: the speech params for
    ``params: speech`` (so the stage serves text to speech), else the generic ones."""
    return SpeechSamplingParams if runner_args.get("params") == "speech" else GenericSamplingParams


def program_args(runner_args: Mapping[str, Any]) -> ProgramArgs:
    """A subprocess stage's ``runner_args`` decoded and checked; ConfigError whose ``path`` is
    relative to ``runner_args`` (``argv[2]``)."""
    return _decode(runner_args, ProgramArgs)


def worker_args(runner_args: Mapping[str, Any]) -> WorkerArgs:
    """A worker stage's ``runner_args`` decoded and checked, as :func:`program_args`."""
    return _decode(runner_args, WorkerArgs)


def _decode(runner_args: Mapping[str, Any], cls: type[_A]) -> _A:
    try:
        args = msgspec.convert(dict(runner_args), cls, strict=True)
    except msgspec.ValidationError as e:
        message, _, where = str(e).partition(" - at `")
        if where.startswith("key` in `"):  # a mapping's key of the wrong type: the mapping's path
            where, message = where.removeprefix("key` in `"), f"{message} (a key)"
        unknown = re.search(r"unknown field `([^`]*)`", message)
        path = where.removeprefix("$").rstrip("`").lstrip(".")
        if unknown:
            message, path = "unknown key", f"{path}.{unknown.group(1)}".lstrip(".")
        raise ConfigError(message, path=path or None) from None
    names = set(RUNNER_PLACEHOLDERS)
    for i, output in enumerate(args.outputs):
        at = f"outputs[{i}]"
        if not _NAME_RE.match(output.name) or output.name in names:
            raise ConfigError(f"{output.name!r} is not a free placeholder name", path=f"{at}.name")
        names.add(output.name)
        rel = args.output_path(output)
        parts = rel.replace("\\", "/").split("/")
        if os.path.isabs(rel) or ".." in parts or not rel or "\x00" in rel:
            raise ConfigError(f"{rel!r}: an output's path is relative to the request's folder", path=f"{at}.path")
        if output.kind is None and os.path.splitext(rel)[1].lower() not in KIND_OF_SUFFIX:
            raise ConfigError(f"cannot tell the kind of {rel!r} from its suffix: give `kind`", path=f"{at}.kind")
    for i, template in enumerate(args.argv):
        try:
            found = placeholders(template)
        except ValueError as e:
            raise ConfigError(str(e), path=f"argv[{i}]") from None
        if "prompt" in found and args.prompt != "argv":
            raise ConfigError("{prompt} is there only with `prompt: argv`", path=f"argv[{i}]")
        if "python" in found and args.python is None:
            raise ConfigError("{python} needs `python:` (an interpreter's absolute path)", path=f"argv[{i}]")
        if "\x00" in template:  # no program can be given one: every request would fail to start
            raise ConfigError("an argument cannot hold a NUL character", path=f"argv[{i}]")
    for name, value in args.env.items():
        if not name or "=" in name or "\x00" in name or "\x00" in value:
            raise ConfigError(
                "an environment variable's name is not empty and holds no `=` or NUL, its value no NUL",
                path=f"env.{name}",
            )
    if isinstance(args, WorkerArgs):
        _check_worker(args)
    for key in ("python", "cwd"):
        value = getattr(args, key)
        if value is not None and (not os.path.isabs(value) or "\x00" in value):
            raise ConfigError(f"{value!r} is not an absolute path", path=key)
    if args.params == "speech":
        _check_speech(args)
    elif args.voices or args.speed or args.seconds_per_char:
        raise ConfigError("voices, speed and seconds_per_char are for `params: speech`", path="params")
    return args


def _check_worker(args: WorkerArgs) -> None:
    for i, template in enumerate(args.argv):
        extra = [n for n in placeholders(template) if n not in WORKER_PLACEHOLDERS]
        if extra:
            raise ConfigError(
                f"a worker is started once, before any request: its argv takes only {{python}}, got {{{extra[0]}}}",
                path=f"argv[{i}]",
            )
    if args.prompt != "stdin" or args.stdout != "ignore":
        raise ConfigError("a worker gets the prompt and answers in its protocol lines", path="prompt")


def _check_speech(args: ProgramArgs) -> None:
    if not any(args.output_kind(o) == "audio" for o in args.outputs):
        raise ConfigError("a speech stage reads back an audio output", path="outputs")
    if args.seconds_per_char is None:
        raise ConfigError(
            "a speech stage says how long a character may speak (the estimate checked against "
            "engine_args.max_speech_seconds before a request is queued)",
            path="seconds_per_char",
        )
    if args.speed is not None:
        if (
            not _NAME_RE.match(args.speed.placeholder)
            or args.speed.placeholder in SpeechSamplingParams.__struct_fields__
        ):
            raise ConfigError(f"{args.speed.placeholder!r} is not a free placeholder name", path="speed.placeholder")
        if args.speed.min > args.speed.max:
            raise ConfigError("min is more than max", path="speed")
    known = {*SpeechSamplingParams.__struct_fields__, *(() if args.speed is None else (args.speed.placeholder,))}
    for name in [] if isinstance(args, WorkerArgs) else args.param_names():
        if name not in known:
            raise ConfigError(f"{{{name}}} is neither a speech param nor filled by the runner", path="argv")
    for voice, value in args.voices.items():
        if not value or "\x00" in value:
            raise ConfigError("a voice's value is a non-empty string", path=f"voices.{voice}")


def speed_bounds(args: ProgramArgs) -> tuple[float, float] | None:
    """The ``speed`` range a speech stage takes (its ``speed`` map's ``[min, max] / scale``)."""
    if args.speed is None:
        return None
    return args.speed.min / args.speed.scale, args.speed.max / args.speed.scale


def configure_program(runner_args: Mapping[str, Any]) -> type[msgspec.Struct]:
    """A subprocess stage's ``runner_args`` checked (ConfigError), and its params class: the
    :attr:`~omni_runtime.stage.runners.core_stage_types.StageType.configure` of ``subprocess``."""
    program_args(runner_args)
    return program_params_class(runner_args)


def configure_worker(runner_args: Mapping[str, Any]) -> type[msgspec.Struct]:
    """A worker stage's ``runner_args`` checked (ConfigError), and its params class."""
    worker_args(runner_args)
    return program_params_class(runner_args)
