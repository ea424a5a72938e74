"""Deploy configuration: the ``stage_args:`` YAML, decoded into typed msgspec Structs.

Decoding validates once, at load: unknown keys, wrong types, out-of-range values and a broken
stage graph are :class:`~omni_runtime.exceptions.ConfigError`\\ s that name the file and the YAML
path, e.g. ``tiny-sd.yaml: stage_args[0].engine_args.max_num_seqs: Expected `int` >= 1, got 0``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
import yaml

from omni_runtime.acceleration import LayerwiseCasting, Offload, Quantization, StepCache, check_acceleration
from omni_runtime.backend_registry import BACKENDS, backend_options
from omni_runtime.bounds import FIELD_BOUNDS, LORA_NAME_PATTERN, MAX_TOKENS
from omni_runtime.exceptions import ConfigError, InvalidRequestError
from omni_runtime.media import OUTPUT_TYPES, OutputType
from omni_runtime.params import check_lora_path
from omni_runtime.serialization import find_unencodable
from omni_runtime.stage.runners.stage_types import stage_types

_Struct = {"kw_only": True, "forbid_unknown_fields": True}


if TYPE_CHECKING:  # built at run time from FIELD_BOUNDS; to a type checker the plain number types
    MaxNumSeqs = int
    RequestBatchMaxWaitMs = float
else:
    MaxNumSeqs = FIELD_BOUNDS["max_num_seqs"].annotated
    RequestBatchMaxWaitMs = FIELD_BOUNDS["request_batch_max_wait_ms"].annotated

#: The fields each built-in control call takes; their bounds are those of :data:`FIELD_BOUNDS`.
CONTROL_CALL_FIELDS: dict[str, tuple[str, ...]] = {
    "set_batching": ("max_num_seqs", "request_batch_max_wait_ms"),
}


def check_control_kwargs(method: str, kwargs: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The keyword arguments of a built-in control call, checked against the YAML's bounds; another
    method's (a runner's ``rpc_*``) are returned as they are, for its own checks. Raises
    InvalidRequestError naming ``prefix`` + the field (``kwargs.max_num_seqs``) and its bound."""
    fields = CONTROL_CALL_FIELDS.get(method)
    if fields is None:
        return kwargs
    checked: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name not in fields:
            raise InvalidRequestError(
                f"`{prefix}{name}`: {method} takes only {', '.join(fields)}", param=f"{prefix}{name}"
            )
        checked[name] = None if value is None else FIELD_BOUNDS[name].check(value, f"{prefix}{name}")
    return checked


#: Where a stage's replicas run: a name in the backend registry
#: (:mod:`omni_runtime.backend_registry`): ``process`` (a spawned process each, ZMQ and
#: shared memory), ``inproc`` (in the orchestrator's own process; for tests and for debugging a
#: runner) or ``ray`` (Ray actors placed across a Ray cluster; ``pip install omni_runtime[ray]``).
Backend = str


class RuntimeConfig(msgspec.Struct, **_Struct):
    """Where and how a stage runs: the keys every backend reads, and :attr:`options`, the chosen
    backend's own (``ProcessOptions``, ``RayOptions``...), which a YAML writes flat beside them."""

    #: Where the replicas run: ``process`` (the default), ``inproc`` or ``ray``; see :data:`Backend`.
    backend: Backend | None = None
    #: The older spelling: ``process: false`` is ``backend: inproc``, ``true`` is ``process``.
    #: Resolved into ``backend`` at load (and then shown as null).
    process: bool | None = None
    #: Number of replicas of this stage; requests go to the least-loaded live one.
    num_replicas: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    #: torch device string for the model (``cpu``, ``cuda``, ``cuda:1``).
    devices: str = "cpu"
    #: torch intra-op threads per replica process; 0 = cores / total replicas (at least 1).
    #: Several processes each using every core oversubscribe and run several times slower.
    torch_threads: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    #: Seconds a replica may take to load its model and say READY.
    startup_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    #: Restart a replica that dies, with exponential backoff, at most this many times (0 = never).
    max_restarts: Annotated[int, msgspec.Meta(ge=0)] = 3
    #: A replica that answers no heartbeat for this many seconds (stopped, or its event loop
    #: blocked) is killed: its requests fail with StageDeadError and it is restarted. 0 = off.
    heartbeat_timeout_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 10.0
    #: A forward that makes no progress (no denoising step, no streamed token: no call of
    #: ``ctx.is_aborted`` or ``ctx.emit``) for this many seconds is wedged, e.g. stuck in native
    #: code; its replica is killed and restarted like a silent one. 0 = off.
    stall_timeout_s: Annotated[float, msgspec.Meta(ge=0)] = 120.0
    #: The backend's own settings, an instance of its ``StageBackend.options`` struct (filled in
    #: at load from the flat ``runtime:`` keys that struct declares; its defaults when None).
    options: Any = None

    def __post_init__(self) -> None:
        if self.process is not None:
            implied = "process" if self.process else "inproc"
            if self.backend is not None and self.backend != implied:
                raise ValueError(
                    f"`process: {str(self.process).lower()}` is the older spelling of `backend: {implied}` "
                    f"and contradicts `backend: {self.backend}`; keep `backend` only"
                )
            self.backend, self.process = implied, None
        elif self.backend is None:
            self.backend = "process"
        if self.backend not in BACKENDS:
            raise ValueError(f"Invalid enum value {self.backend!r}: expected one of {', '.join(BACKENDS)}")
        cls = backend_options(self.backend)
        if self.options is None or isinstance(self.options, dict):
            self.options = msgspec.convert(self.options or {}, cls)
        elif not isinstance(self.options, cls):
            raise TypeError(f"`options` of a {self.backend} stage must be a {cls.__name__}")

    @property
    def backend_name(self) -> Backend:
        """``backend`` as resolved at load (``process: ...`` and the default filled in): never None."""
        assert self.backend is not None
        return self.backend


def _split_runtime(runtime: Any, at: str, source: str) -> Any:
    """A ``runtime:`` mapping with the chosen backend's own keys (written flat, or under
    ``options:`` as a loaded config shows them) decoded into its options struct, at ``options``.
    Keys another backend declares are accepted and dropped, as that backend would ignore them
    here; any other key is left for :class:`RuntimeConfig` to report as unknown."""
    if not isinstance(runtime, dict):
        return runtime
    backend = runtime.get("backend")
    if backend is None:
        backend = "inproc" if runtime.get("process") is False else "process"
    if not isinstance(backend, str):
        return runtime  # RuntimeConfig says what is wrong with it
    if backend not in BACKENDS:
        raise ConfigError(
            f"Invalid enum value {backend!r}: expected one of {', '.join(BACKENDS)}",
            path=f"{at}.backend",
            source=source,
        )
    rest = dict(runtime)
    given = rest.pop("options", None)
    merged = {**given} if isinstance(given, dict) else {}
    own = backend_options(backend).__struct_fields__
    others = {f for name in BACKENDS if name != backend for f in backend_options(name).__struct_fields__}
    for key in list(rest):
        if key in own or (key in others and key not in RuntimeConfig.__struct_fields__):
            merged[key] = rest.pop(key)
    merged = {k: v for k, v in merged.items() if k in own or k not in others}
    try:
        rest["options"] = msgspec.convert(merged, backend_options(backend), strict=True)
    except msgspec.ValidationError as e:
        raise _decode_error(e, merged, at, source) from None
    return rest


class TorchCompile(msgspec.Struct, **_Struct):
    """``engine_args.torch_compile``: ``torch.compile`` the denoiser (UNet or transformer) at load."""

    #: ``inductor`` (kernels generated for the machine: needs a C++ compiler on CPU, minutes of
    #: warm-up on the first request of each shape) or any other registered backend.
    backend: str = "inductor"
    #: ``default``, ``reduce-overhead`` (CUDA graphs), ``max-autotune``... (inductor only).
    mode: str | None = None
    fullgraph: bool = False
    #: None: let torch decide (it recompiles with dynamic shapes after a second size).
    dynamic: bool | None = None
    #: Compile only the denoiser's repeated blocks (diffusers' ``compile_repeated_blocks``; the flux
    #: and wan transformers, the sd and sdxl UNets): one compilation serves every block of a kind, so
    #: it takes a fraction of the time.
    regional: bool = False
    #: Run one image at the native size and default step count at load, so the compilation is paid
    #: at start-up (the time is logged and in ``get_stats`` as ``compile_warmup_s``), not by the
    #: first request; other sizes still compile on first use.
    warmup: bool = False


class BatchProfile(msgspec.Struct, **_Struct):
    """``engine_args.batch_profile``: before READY, time forwards of the runner's representative
    request at a few batch sizes and seed the learned cost of a batch with them, so the learned
    policy acts from the first request. The seconds it took and the fit are in READY and
    ``get_stats`` (``batch_profile``)."""

    #: Batch sizes timed, in order (those above ``max_num_seqs`` or the runner's cap are skipped).
    sizes: Annotated[list[Annotated[int, msgspec.Meta(ge=1, le=1024)]], msgspec.Meta(min_length=1, max_length=16)] = (
        msgspec.field(default_factory=lambda: [1, 2, 4])
    )
    #: Forwards per size.
    repeats: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    #: A bound on the whole profile (s): past it, the running forward is aborted at its next step
    #: and the profile stops, keeping what it measured.
    max_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 20.0


class EngineArgs(msgspec.Struct, **_Struct):
    """Scheduling knobs of one stage, and how a diffusion stage runs its model."""

    #: Most requests fused into one forward(); 1..1024 (:data:`FIELD_BOUNDS`, as ``set_batching``).
    max_num_seqs: MaxNumSeqs = 1
    #: Extra admission wait (ms) before a new wave, to let compatible requests join it.
    #: 0 dispatches the first request at once; at most 60,000 (:data:`FIELD_BOUNDS`).
    request_batch_max_wait_ms: RequestBatchMaxWaitMs = 0.0
    #: Most requests waiting in this replica's queue; past it a request is refused (QueueFullError).
    max_queue_len: Annotated[int, msgspec.Meta(ge=1)] = 4096
    #: torch dtype of the model weights (``float32``, ``float16``, ``bfloat16``).
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    #: Where a diffusion stage's weights come from: ``auto`` reads them from the model directory;
    #: ``dummy`` builds every model component ``model_index.json`` lists from its config with random
    #: (seeded) weights, right on the stage's device in ``dtype``, and reads no weight file
    #: (schedulers and tokenizers still load from theirs). For benchmarks and tests of full-size
    #: shapes from a directory of configs, as vLLM's ``--load-format dummy``; the images are noise.
    load_format: Literal["auto", "dummy"] = "auto"
    #: Which waiting requests form the next wave: ``oldest_key`` (the oldest request's key, filled
    #: with every waiting request of that key) or ``fifo`` (the head and the run of same-key
    #: requests right behind it; a baseline for comparisons).
    scheduling_policy: Literal["oldest_key", "fifo"] = "oldest_key"
    #: Largest height * width a diffusion request may ask for. ``null``: 4 x the model's native area
    #: (a 512 px model takes up to 1024 x 1024), or 2048 x 2048 when the model does not say.
    max_pixels: Annotated[int, msgspec.Meta(ge=64)] | None = None
    #: Quiet time (ms) after the latest arrival that ends an admission hold early. ``null`` adapts
    #: it to the gaps between recent arrivals (at least ``min(wait/4, 5 ms)``, at most the wait).
    batch_quiet_window_ms: Annotated[float, msgspec.Meta(ge=0, le=60_000)] | None = None
    #: Run diffusion requests step by step: requests join and leave a running denoising batch
    #: between steps (continuous batching). A runner or pipeline that cannot falls back to
    #: request-level batching and logs why.
    step_execution: bool = False
    #: How waves are formed. ``learned``: a per-key model of a forward's (or step's) time against
    #: its batch size, learned from every wave, caps the batch where throughput stops rising and
    #: holds a wave open only while one more request saves more than its expected wait
    #: (``request_batch_max_wait_ms`` stays the upper bound); until it has evidence for a key, the
    #: window applies. ``window``: hold up to ``request_batch_max_wait_ms``, ended early by the
    #: quiet window, and batch up to ``max_num_seqs``.
    batch_policy: Literal["learned", "window"] = "window"
    #: A latency target (ms) for this stage, acted on with ``batch_policy: learned`` once the model
    #: knows a key: no admission hold lasts past the point where the wave's head would miss it.
    slo_ms: Annotated[float, msgspec.Meta(gt=0, le=3_600_000)] | None = None
    #: With ``slo_ms``: refuse (429 with ``Retry-After``) a request the learned cost says would
    #: finish later than ``slo_ms``, instead of serving it late.
    slo_shed: bool = False
    #: A short profile at start-up that seeds the learned cost of a batch (off by default).
    batch_profile: BatchProfile | None = None
    #: ``torch.compile`` the denoiser (``true`` for the defaults, or ``{backend, mode, fullgraph,
    #: dynamic}``). Off by default: worth it on a GPU for a long-running server.
    torch_compile: bool | TorchCompile = False
    #: Weights and activations of the UNet / VAE convolutions in NHWC (channels-last) memory
    #: format: faster convolutions on most GPUs and with oneDNN on recent CPUs.
    channels_last: bool = False
    #: Attention computed in slices to cut peak memory: ``auto`` (half the heads at a time),
    #: ``max`` (one at a time) or a slice size; null = off.
    attention_slicing: Literal["auto", "max"] | Annotated[int, msgspec.Meta(ge=1)] | None = None
    #: Decode (and encode) large images and videos with the VAE in overlapping tiles, blended at
    #: the seams: peak memory bounded by the tile, not the frame, for some time (tiles overlap)
    #: and seams that differ slightly from an untiled decode. Where the VAE has it (image VAEs,
    #: Wan's, LTX's).
    vae_tiling: bool = False
    #: Decode a batch with the VAE one sample at a time: the decode's peak memory is one video's
    #: (or image's), not the batch's, for a decode that uses the device less fully.
    vae_slicing: bool = False
    #: Largest ``num_frames x height x width`` a video request may ask for, and that a fused
    #: batch may total (a wave past it runs in smaller parts): what bounds a video's memory, which
    #: grows with its frames as with its pixels. ``null``: no bound beyond ``max_pixels`` and the
    #: model's most frames.
    max_video_pixels: Annotated[int, msgspec.Meta(ge=64)] | None = None
    #: Longest clip (seconds) one request to a speech stage may make: a request whose text and
    #: ``speed`` could make more is refused before it is queued (docs/configuration.md, "Speech
    #: length"). What a clip holds while it is made grows with its length (about 4 MB a second
    #: for tiny-tts on a CPU), and a wave holds ``max_num_seqs`` of them.
    max_speech_seconds: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0
    #: Most tokens one request to a text stage (``text``, ``omni_thinker``) may generate: a request
    #: whose ``max_tokens`` is larger is refused before it is queued, and the stage's default
    #: ``max_tokens`` is bounded by it (docs/configuration.md, "Text length"). ``null``: no bound
    #: but the model's context and ``max_tokens``' own range (1 to 8192).
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)] | None = None
    #: Give memory a forward freed back to the system at once: glibc's mmap threshold fixed at
    #: 4 MiB in the replica's process (its dynamic raise off), so that every block of that size or
    #: more is mapped for itself and unmapped when freed. Without it a stage whose forwards vary
    #: in shape (speech of varied lengths, images of varied sizes) fragments its heap and its RSS
    #: keeps rising (``tiny-tts``: 1.2 to 3.4 GB over 8 rounds of speech; with it, level at
    #: 0.94 GB from round 4; docs/reliability.md, "Memory"). A no-op where the C library is not glibc.
    return_freed_memory: bool = True
    #: Priority aging: a waiting request gains one priority level per this many seconds it waits,
    #: so a low-priority request is served at last however many higher ones keep arriving.
    priority_aging_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)] = 10.0
    #: Seconds between two bursts of progress events. ``null`` adapts it to what a burst costs
    #: (0.3 to 1 s, about 1 % of the model's time); a number fixes it, and ``0`` sends progress at
    #: every step (a test, or a client that wants every step whatever the cost). At most 60 s.
    progress_interval_s: Annotated[float, msgspec.Meta(ge=0, le=60)] | None = None
    #: LoRA adapters a diffusion stage offers by name: ``{name: absolute path}`` of a local adapter
    #: directory (or ``.safetensors`` file). Requests pick one with ``lora: {name, scale}``; HTTP
    #: clients can only name these (and those added with ``collective_rpc("add_lora")``).
    loras: dict[Annotated[str, msgspec.Meta(pattern=LORA_NAME_PATTERN)], str] = msgspec.field(default_factory=dict)
    #: Most LoRA adapters kept loaded in each replica; past it the least recently used is unloaded
    #: (and loaded again from disk when a request asks for it).
    max_loras: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    #: Largest LoRA adapter file a stage opens, in MiB: a bigger one is refused from its size
    #: alone, before a byte is read (adapters are megabytes; a file of gigabytes is a mistake).
    max_lora_file_mb: Annotated[int, msgspec.Meta(ge=1, le=64 * 1024)] = 2048
    #: Step caching of the denoiser (diffusers' cache hooks): ``{type: first_block | taylorseer |
    #: mag | pab, ...}`` (omni_runtime/acceleration.py); requests may override it with ``cache``.
    cache: StepCache | None = None
    #: Weights quantized at load (torchao through diffusers): ``{quant_type: int8wo, components: [transformer]}``.
    quantization: Quantization | None = None
    #: The denoiser's weights stored in a small dtype and cast per layer as it runs.
    layerwise_casting: LayerwiseCasting | None = None
    #: Weights kept in CPU memory and moved to the accelerator per model, per layer or per group of
    #: blocks (``model | sequential | group``); needs a non-CPU ``runtime.devices``.
    offload: Offload | None = None

    def __post_init__(self) -> None:
        for name, path in self.loras.items():
            check_lora_path(path, f"loras.{name}")


#: Most items / tokens / words one chunk may hold, and most chunks of one request outstanding
#: downstream: past these a chunk policy is a mistake, not a tuning.
MAX_CHUNK_SIZE = 65_536
MAX_BUFFERED_CHUNKS = 1024


class InputChunking(msgspec.Struct, **_Struct):
    """``input_chunking``: this stage takes its upstream's streamed output in chunks, one
    sub-request per chunk, instead of waiting for the upstream's whole output (see
    docs/configuration.md "Chunked hand-off")."""

    #: ``sentence``: upstream text, cut after a sentence end (``.``, ``!``, ``?``, ``;``, ``:``,
    #: a newline) or once a chunk holds ``size`` words; ``tokens``: upstream text, ``size`` streamed
    #: deltas (a text stage streams one per token); ``items``: upstream tensors, ``size`` items
    #: along the first axis of each array (codes, frames).
    policy: Literal["sentence", "tokens", "items"]
    #: Words (``sentence``), deltas (``tokens``) or items (``items``) per chunk; the last chunk
    #: holds what is left.
    size: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNK_SIZE)] = 32
    #: The first chunk's size (None: ``size``): a smaller first chunk brings the downstream's first
    #: output sooner (the first audio of a speech stage), and later chunks stay ``size``.
    first_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNK_SIZE)] | None = None
    #: Most chunks of one request submitted to this stage and not yet done; further ready chunks
    #: wait in the orchestrator until one is.
    max_buffered: Annotated[int, msgspec.Meta(ge=1, le=MAX_BUFFERED_CHUNKS)] = 2


class StageConfig(msgspec.Struct, **_Struct):
    """One entry of ``stage_args:``."""

    stage_id: Annotated[int, msgspec.Meta(ge=0)]
    #: ``diffusion`` | ``text`` | ``echo`` | ``module:Class`` of a custom runner.
    stage_type: str
    #: Local model directory, or ``builtin:<name>`` (made offline on first use).
    model: str | None = None
    runtime: RuntimeConfig = msgspec.field(default_factory=RuntimeConfig)
    engine_args: EngineArgs = msgspec.field(default_factory=EngineArgs)
    #: Upstream stage ids whose outputs feed this stage; empty = takes the caller's prompt.
    engine_input_source: list[int] = msgspec.field(default_factory=list)
    #: ``module:function`` mapping upstream outputs (and the original prompt) to this stage's input.
    custom_process_input_func: str | None = None
    #: Whether this stage's output is delivered to the caller.
    final_output: bool = False
    #: What it delivers (omni_runtime/media.py ``OutputType``): what ``modalities`` selects by.
    final_output_type: OutputType | None = None
    #: Defaults for the stage's sampling params; a request's own values win.
    default_sampling_params: dict[str, Any] = msgspec.field(default_factory=dict)
    #: Runner-specific options (e.g. ``{"role": "decoder"}`` for a split pipeline).
    runner_args: dict[str, Any] = msgspec.field(default_factory=dict)
    #: Take the one upstream stage's streamed output in chunks (None: its whole output, once).
    input_chunking: InputChunking | None = None


class DeployConfig(msgspec.Struct, **_Struct):
    """A whole deploy YAML."""

    stage_args: Annotated[list[StageConfig], msgspec.Meta(min_length=1)]
    #: The served model name (``/v1/models``); defaults to the file's stem.
    model: str | None = None
    #: Most requests admitted by the engine and not yet finished; past it QueueFullError / 429.
    max_pending: Annotated[int, msgspec.Meta(ge=1)] = 1024
    #: Deadline (s) of a request that sets none; ``null`` = none.
    default_timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None

    def stage(self, stage_id: int) -> StageConfig:
        for s in self.stage_args:
            if s.stage_id == stage_id:
                return s
        raise KeyError(stage_id)

    @property
    def final_stage_ids(self) -> list[int]:
        return [s.stage_id for s in self.stage_args if s.final_output]


# --------------------------------------------------------------------------- loading

_AT_RE = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.S)


def _value_at(data: Any, path: str) -> Any:
    """The value at a msgspec path like ``.stage_args[0].engine_args.max_num_seqs``."""
    for key, index in re.findall(r"\.([A-Za-z_][\w-]*)|\[(\d+)\]", path):
        try:
            data = data[key] if key else data[int(index)]
        except (KeyError, IndexError, TypeError):
            return msgspec.UNSET
    return data


def _decode_error(e: msgspec.ValidationError, data: Any, prefix: str, source: str) -> ConfigError:
    """msgspec's ``"<what> - at `$.a.b`"`` as a ConfigError at the YAML path ``prefix.a.b``."""
    match = _AT_RE.match(str(e))
    assert match is not None  # every part of the pattern is optional
    message, path = match.groups()
    path = (path or "").lstrip(".")
    unknown = re.search(r"unknown field `([^`]*)`", message)
    if unknown:
        path = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        return ConfigError("unknown key", path=_join(prefix, path), source=source)
    got = _value_at(data, "." + path) if path else msgspec.UNSET
    if got is not msgspec.UNSET and "got" not in message:
        message = f"{message}, got {got!r}"
    return ConfigError(message, path=_join(prefix, path) or None, source=source)


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def bundled_config_dir() -> Path:
    """Folder of the bundled deploy YAMLs (``stage_configs/``), installed or in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "stage_configs", here.parent / "stage_configs"):
        if candidate.is_dir():
            return candidate
    raise ConfigError("bundled stage_configs folder not found")


def bundled_config_names() -> list[str]:
    return sorted(p.stem for p in bundled_config_dir().glob("*.yaml"))


def parse_config(data: Any, source: str = "<config>") -> DeployConfig:
    """Validate a decoded YAML document into a DeployConfig. Each stage is checked on its own
    first, so a file with several broken stages reports all of them in one ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping with a `stage_args:` list, got {type(data).__name__}", source=source)
    stages = data.get("stage_args")
    if isinstance(stages, list):
        errors = []
        split = []
        for i, stage in enumerate(stages):
            try:
                if isinstance(stage, dict) and "runtime" in stage:
                    stage = {**stage, "runtime": _split_runtime(stage["runtime"], f"stage_args[{i}].runtime", source)}
                split.append(stage)
                msgspec.convert(stage, StageConfig, strict=True)
            except ConfigError as e:
                errors.append(e)
            except msgspec.ValidationError as e:
                errors.append(_decode_error(e, stage, f"stage_args[{i}]", source))
        if errors:
            raise ConfigError.of(errors, source=source)
        data = {**data, "stage_args": split}
    try:
        config = msgspec.convert(data, DeployConfig, strict=True)
    except msgspec.ValidationError as e:
        raise _decode_error(e, data, "", source) from None
    # Every stage process gets its config as msgpack: a value it cannot carry (a lone surrogate,
    # an integer past 64 bits) is this file's error, not a failure to start a replica.
    found = find_unencodable(msgspec.to_builtins(config))
    if found is not None:
        raise ConfigError(found[1], path=found[0], source=source)
    validate_graph(config, source)
    for i, s in enumerate(config.stage_args):
        check_acceleration(s.engine_args, s.runtime.devices, f"stage_args[{i}]", source, s.engine_args.step_execution)
        if s.engine_args.load_format == "dummy" and s.stage_type != "diffusion":
            raise ConfigError(
                f"load_format: dummy builds the components of a diffusers model directory (stage_type diffusion); "
                f"a {s.stage_type} stage loads its own model",
                path=f"stage_args[{i}].engine_args.load_format",
                source=source,
            )
    return config


def validate_graph(config: DeployConfig, source: str = "<config>") -> None:
    """Stage ids unique, sources known, no cycles, every stage reaches a final output."""
    known = stage_types()
    ids: dict[int, int] = {}
    for i, s in enumerate(config.stage_args):
        if s.stage_id in ids:
            raise ConfigError(
                f"duplicate stage_id {s.stage_id} (also stage_args[{ids[s.stage_id]}])",
                path=f"stage_args[{i}].stage_id",
                source=source,
            )
        ids[s.stage_id] = i
        if ":" not in s.stage_type and s.stage_type not in known:
            raise ConfigError(
                f"unknown stage_type {s.stage_type!r}; expected one of {', '.join(known)} or module:Class",
                path=f"stage_args[{i}].stage_type",
                source=source,
            )
        if s.final_output and s.final_output_type is None:
            raise ConfigError(
                f"a final_output stage needs final_output_type ({' | '.join(OUTPUT_TYPES)})",
                path=f"stage_args[{i}].final_output_type",
                source=source,
            )
    for i, s in enumerate(config.stage_args):
        for j, src in enumerate(s.engine_input_source):
            if src not in ids:
                raise ConfigError(
                    f"unknown upstream stage id {src}", path=f"stage_args[{i}].engine_input_source[{j}]", source=source
                )
            if src == s.stage_id:
                raise ConfigError(
                    "a stage cannot feed itself", path=f"stage_args[{i}].engine_input_source[{j}]", source=source
                )
    _check_chunking(config, known, source)
    # Cycles: depth-first search over upstream edges.
    state: dict[int, int] = {}  # 1 = on the stack, 2 = done

    def visit(sid: int) -> None:
        state[sid] = 1
        for src in config.stage(sid).engine_input_source:
            if state.get(src) == 1:
                raise ConfigError(
                    f"the stage graph has a cycle through stage {src}",
                    path=f"stage_args[{ids[sid]}].engine_input_source",
                    source=source,
                )
            if state.get(src) is None:
                visit(src)
        state[sid] = 2

    for sid in ids:
        if sid not in state:
            visit(sid)
    finals = set(config.final_stage_ids)
    if not finals:
        raise ConfigError("no stage has final_output: true", path="stage_args", source=source)
    downstream: dict[int, list[int]] = {sid: [] for sid in ids}
    for s in config.stage_args:
        for src in s.engine_input_source:
            downstream[src].append(s.stage_id)
    for sid, i in ids.items():
        seen, todo = set(), [sid]
        while todo:
            cur = todo.pop()
            if cur in seen:
                continue
            seen.add(cur)
            todo.extend(downstream[cur])
        if not seen & finals:
            raise ConfigError(f"stage {sid} has no path to a final output", path=f"stage_args[{i}]", source=source)


def _check_chunking(config: DeployConfig, known: dict[str, Any], source: str) -> None:
    """A chunked stage has exactly one upstream, and that upstream streams: a text stage (or
    another stage type that says it streams), a custom runner (which may), or a chunked stage
    (whose output streams one delta per chunk)."""
    for i, s in enumerate(config.stage_args):
        if s.input_chunking is None:
            continue
        at = f"stage_args[{i}].input_chunking"
        if len(s.engine_input_source) != 1:
            have = "no upstream stage" if not s.engine_input_source else "several upstream stages"
            raise ConfigError(
                f"input_chunking needs exactly one upstream stage in engine_input_source; this stage has {have}",
                path=at,
                source=source,
            )
        up = config.stage(s.engine_input_source[0])
        kind = known.get(up.stage_type)
        if up.input_chunking is None and ":" not in up.stage_type and not (kind is not None and kind.streams):
            raise ConfigError(
                f"input_chunking: the upstream stage {up.stage_id} ({up.stage_type}) does not stream its output",
                path=at,
                source=source,
            )


def load_config(model: str | Path) -> DeployConfig:
    """Resolve ``Omni(model=...)``: a bundled config name, a YAML path, or a diffusers model dir."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise ConfigError(f"{path} is a directory but not a diffusers model (no model_index.json)")
        return single_diffusion_config(str(path.resolve()), name=path.name)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        source = path.name
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"not valid YAML: {e}", source=source) from None
        config = parse_config(data, source)
        return config if config.model else msgspec.structs.replace(config, model=path.stem)
    bundled = bundled_config_dir() / f"{model}.yaml"
    if bundled.is_file():
        return load_config(bundled)
    raise ConfigError(
        f"unknown model {str(model)!r}: not a bundled config ({', '.join(bundled_config_names())}), "
        "a YAML file, or a local diffusers model directory"
    )


def single_diffusion_config(model_dir: str, name: str) -> DeployConfig:
    """A one-stage diffusion deploy config for a local diffusers model directory."""
    return parse_config(
        {
            "model": name,
            "stage_args": [
                {
                    "stage_id": 0,
                    "stage_type": "diffusion",
                    "model": model_dir,
                    "final_output": True,
                    "final_output_type": "image",
                }
            ],
        },
        source=name,
    )


def with_ray_address(config: DeployConfig, address: str | None) -> DeployConfig:
    """``ray_address`` (a ``RayOptions`` key) set to ``address`` on every ray stage (None: unchanged)."""
    if address is None or not any(s.runtime.backend == "ray" for s in config.stage_args):
        return config
    data = msgspec.to_builtins(config)
    for s in data["stage_args"]:
        if s["runtime"]["backend"] == "ray":
            s["runtime"]["options"]["ray_address"] = address
    return parse_config(data, source="ray_address")


#: Keyword arguments (``Omni(..., devices="cuda:0")``, ``serve --device``) that set a field of
#: the target stages' ``runtime:`` rather than of their ``engine_args:``.
RUNTIME_OVERRIDES = ("devices", "num_replicas", "torch_threads")


def with_engine_overrides(config: DeployConfig, **overrides: Any) -> DeployConfig:
    """Apply keyword engine args (``max_num_seqs=4``, ``dtype="float16"``...) and the runtime
    knobs of :data:`RUNTIME_OVERRIDES` (``devices="cuda:0"``, ``num_replicas=2``) to the diffusion
    stages. A config without a diffusion stage applies them to every stage. Unknown names and bad
    values are ConfigErrors naming the argument.
    """
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if not overrides:
        return config
    known = (*EngineArgs.__struct_fields__, *RUNTIME_OVERRIDES)
    unknown = set(overrides) - set(known)
    if unknown:
        raise ConfigError(f"unknown engine argument(s): {', '.join(sorted(unknown))}; expected {', '.join(known)}")
    targets = [s.stage_id for s in config.stage_args if s.stage_type == "diffusion"] or [
        s.stage_id for s in config.stage_args
    ]
    runtime = {k: v for k, v in overrides.items() if k in RUNTIME_OVERRIDES}
    engine = {k: v for k, v in overrides.items() if k not in RUNTIME_OVERRIDES}
    data = msgspec.to_builtins(config)
    for s in data["stage_args"]:
        if s["stage_id"] in targets:
            s.setdefault("engine_args", {}).update(engine)
            s["runtime"] = {**s.get("runtime", {}), **runtime}
            s["runtime"].pop("process", None)  # resolved already; backend carries it
    return parse_config(data, source="engine arguments")
