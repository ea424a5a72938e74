"""The structs a stage entry's sections decode into: ``runtime:`` (:class:`RuntimeConfig`),
``engine_args:`` (:class:`EngineArgs`, with :class:`TorchCompile`, :class:`BatchProfile`,
:class:`PromptCache` and :class:`ResultCache`) and
``input_chunking:`` (:class:`InputChunking`), and the checks of the control calls that set
``engine_args`` fields at run time (:func:`check_control_kwargs`).

Each struct checks its own fields as it is decoded; :mod:`omni_runtime.config` decodes a whole
deploy YAML into them, names the YAML path of any mistake, and re-exports every name here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from omni_runtime.acceleration import LayerwiseCasting, Offload, Quantization, StepCache
from omni_runtime.backend_registry import BACKENDS, backend_options
from omni_runtime.bounds import FIELD_BOUNDS, LORA_NAME_PATTERN, MAX_TOKENS
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.params import check_lora_path

_Struct = {"kw_only": True, "forbid_unknown_fields": True}


if TYPE_CHECKING:  # built at run time from FIELD_BOUNDS; to a type checker the plain number types
    MaxNumSeqs = int
    RequestBatchMaxWaitMs = float
    BatchQuietWindowMs = float
else:
    MaxNumSeqs = FIELD_BOUNDS["max_num_seqs"].annotated
    RequestBatchMaxWaitMs = FIELD_BOUNDS["request_batch_max_wait_ms"].annotated
    BatchQuietWindowMs = FIELD_BOUNDS["batch_quiet_window_ms"].annotated

#: The fields each built-in control call takes; their bounds are those of :data:`FIELD_BOUNDS`.
CONTROL_CALL_FIELDS: dict[str, tuple[str, ...]] = {
    "set_batching": ("max_num_seqs", "request_batch_max_wait_ms", "batch_quiet_window_ms"),
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


class ParallelConfig(msgspec.Struct, **_Struct):
    """``runtime.parallel``: one replica of a diffusion stage as a group of rank processes, one
    device each, that share every denoiser call (docs/configuration.md, "Several devices per
    stage"). The group's size is the product of the degrees."""

    #: Ulysses sequence parallelism: each rank attends over its share of the heads, after an
    #: all-to-all of the tokens (diffusers' context parallelism; transformers with a plan only).
    ulysses_degree: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    #: Ring attention: keys and values passed around the ranks (needs an attention backend that
    #: returns the log-sum-exp, so a GPU one; never on ``cpu``).
    ring_degree: Annotated[int, msgspec.Meta(ge=1, le=16)] = 1
    #: CFG-parallel: the rows of each denoiser call (a guided step's unconditional and conditional
    #: halves) split between the ranks, gathered once per call.
    cfg_parallel_size: Annotated[int, msgspec.Meta(ge=1, le=2)] = 1
    #: Longest wait of a rank in one collective once the group has formed (a peer stopped or
    #: hung): then the group is failed and restarted. It forms within ``startup_timeout_s``.
    collective_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 60.0

    @property
    def world_size(self) -> int:
        return self.ulysses_degree * self.ring_degree * self.cfg_parallel_size


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
    #: Several devices per replica (a diffusion stage on the ``process`` backend): see
    #: :class:`ParallelConfig`. None: one process, one device.
    parallel: ParallelConfig | None = None
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

    def __post_init__(self) -> None:
        # The learned cost fits a line once it has 3 samples at 2 sizes or more: a profile of fewer
        # would add to every start and seed nothing.
        if len(set(self.sizes)) < 2 or len(self.sizes) * self.repeats < 3:
            raise ValueError(
                f"a fit needs at least 3 forwards at 2 sizes or more; sizes {self.sizes} x repeats "
                f"{self.repeats} gives {len(self.sizes) * self.repeats} at {len(set(self.sizes))}"
            )


#: The prompt cache's bound when a stage does not set one: about 280 prompts of SD 1.5 in float16
#: under guidance (231 KiB each: two 77 x 768 embeddings), 16 of Flux in bfloat16 (4 MiB: 512 T5
#: tokens x 4096).
DEFAULT_PROMPT_CACHE_BYTES = 64 * 2**20
#: The largest bound either cache takes (1 TiB): past it a value is a mistake, not a tuning.
MAX_CACHE_BYTES = 2**40


class PromptCache(msgspec.Struct, **_Struct):
    """``engine_args.prompt_cache``: a diffusion stage in step execution keeps each prompt's text
    encoder output (with its negative prompt, guidance mode, rows, size, frames and LoRA adapter),
    least recently used out first, so a prompt seen again is not encoded again
    (docs/configuration.md, "Caches across requests")."""

    #: Most bytes of embeddings (and their prompts' text) kept per replica (on the stage's device);
    #: 0 turns the cache off.
    max_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_CACHE_BYTES)] = DEFAULT_PROMPT_CACHE_BYTES


class ResultCache(msgspec.Struct, **_Struct):
    """``engine_args.result_cache``: a stage keeps the final output of each request that set its
    ``seed``, keyed by its prompt, every params field and its inputs, and answers the same request
    again from it without running the model (docs/configuration.md, "Caches across requests")."""

    #: Most bytes of outputs (images, videos, audio, tensors, text) kept per replica, in host memory.
    max_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_CACHE_BYTES)]


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
    #: ``set_batching`` may fix it on a live engine (:data:`FIELD_BOUNDS`).
    batch_quiet_window_ms: BatchQuietWindowMs | None = None
    #: Run diffusion requests step by step: requests join and leave a running denoising batch
    #: between steps (continuous batching). A runner or pipeline that cannot falls back to
    #: request-level batching and logs why.
    step_execution: bool = False
    #: How waves are formed. ``learned``: a per-key model of a forward's (or step's) time against
    #: its batch size, learned from every wave, caps the batch where throughput stops rising and
    #: holds a wave open only while one more request saves more than its expected wait
    #: (``request_batch_max_wait_ms`` stays the upper bound); until it has evidence for a key, the
    #: window applies. ``window``: hold up to ``request_batch_max_wait_ms``, ended early by the
    #: quiet window, and batch up to ``max_num_seqs``. ``deadline`` (with ``step_execution``):
    #: each step goes to the request with the least slack to its latency target (``slo_ms``),
    #: predicted from the learned cost of a step; requests that can no longer meet theirs wait
    #: behind those that can (docs/configuration.md, "Serving to deadlines"). A runner that cannot
    #: step serves ``deadline`` as ``learned``.
    batch_policy: Literal["learned", "window", "deadline"] = "window"
    #: A latency target (ms) for this stage: with ``batch_policy: learned``, no admission hold lasts
    #: past the point where the wave's head would miss it; with ``deadline``, each request's due time.
    slo_ms: Annotated[float, msgspec.Meta(gt=0, le=3_600_000)] | None = None
    #: With ``slo_ms`` (the stage's or a request's): refuse (429 with ``Retry-After``) a request the
    #: learned cost says would finish later than its target, instead of serving it late.
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
    #: The text encoder's output per prompt, kept across requests (step execution; on by default,
    #: 64 MiB per replica); ``{max_bytes: 0}`` or ``null`` turns it off.
    prompt_cache: PromptCache | None = msgspec.field(default_factory=PromptCache)
    #: Exact results, kept across requests: a request with an explicit ``seed`` whose prompt,
    #: params and inputs equal an earlier one's gets that output again, with no denoising.
    #: Off (``null``) by default; ``{max_bytes: N}`` turns it on.
    result_cache: ResultCache | None = None

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
