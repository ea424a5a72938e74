"""Every message that crosses a thread or process boundary, as msgspec Structs.

Two unions travel on stage sockets (tagged, so the receiver decodes the right type):
``WorkerInbound`` (orchestrator → stage worker) and ``WorkerOutbound`` (worker → orchestrator).
Two more cross the janus queues between the caller's thread and the orchestrator thread:
``EngineInbound`` and ``EngineOutbound``. Arrays and tensors inside ``Any`` fields are encoded by
:mod:`omni_runtime.serialization` as raw buffers, never pickled.
"""

from __future__ import annotations

import unicodedata
from typing import Any, Generic, Literal, TypeVar

import msgspec

from omni_runtime.exceptions import ERROR_TYPES, OmniError, QueueFullError, StageExecutionError, UnavailableError
from omni_runtime.media import MediaItem

#: Every message: keyword-only and frozen; encoded as a msgpack array rather than a map (about
#: 1.2x faster to encode and decode and a third smaller), and not tracked by the cycle collector
#: (a message holds no cycles; a full collection with many of them alive takes half the time).
#: Measured by benchmarks/wire.py (docs/benchmarks.md).
_Msg = {"kw_only": True, "frozen": True, "array_like": True, "gc": False}


class ErrorInfo(msgspec.Struct, **_Msg):
    """A typed error in transit; ``to_exception`` re-creates the same class on the other side."""

    type: str
    message: str
    param: str | None = None
    stage_id: int | None = None
    #: When to retry (s), for an error that says (a full queue, a request shed for its latency target).
    retry_after_s: float | None = None

    @classmethod
    def from_exception(cls, exc: BaseException, stage_id: int | None = None) -> ErrorInfo:
        """Always encodable: a message that quotes input msgpack cannot carry (a lone surrogate)
        keeps it as a visible escape instead of failing the error path itself."""
        if isinstance(exc, OmniError) and type(exc).__name__ in ERROR_TYPES:
            param = getattr(exc, "param", None)
            return cls(
                type=type(exc).__name__,
                message=encodable_text(str(exc)),
                param=encodable_text(param) if isinstance(param, str) else None,
                stage_id=stage_id if stage_id is not None else getattr(exc, "stage_id", None),
                retry_after_s=_retry_after(exc),
            )
        # Anything else raised by a model is this request's execution error.
        return cls(
            type="StageExecutionError", message=encodable_text(f"{type(exc).__name__}: {exc}"), stage_id=stage_id
        )

    def to_exception(self) -> OmniError:
        """The same error class with the same message, param and stage; total for every name
        (an unknown one becomes StageExecutionError), whatever each class's constructor takes."""
        cls = ERROR_TYPES.get(self.type, StageExecutionError)
        # Built without calling the class's own __init__, whose signature differs per class.
        exc = cls.__new__(cls)
        Exception.__init__(exc, self.message)
        if self.param is not None:
            exc.param = self.param
        if self.stage_id is not None:
            exc.stage_id = self.stage_id
        if self.retry_after_s is not None and isinstance(exc, QueueFullError | UnavailableError):
            exc.retry_after_s = self.retry_after_s
        return exc


def _retry_after(exc: BaseException) -> float | None:
    value = getattr(exc, "retry_after_s", None)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e9:  # NaN fails too
        return None
    return float(value)


def encodable_text(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (lone surrogates) replaced by ``\\udXXX`` escapes."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# --------------------------------------------------------------------------- orchestrator -> worker


#: The type of a :class:`StageRequest`'s params: a stage decodes its requests as
#: ``StageRequest[its runner's params class]`` (:func:`omni_runtime.serialization.inbound_decoder`).
P = TypeVar("P")


class StageRequest(msgspec.Struct, Generic[P], tag="request", **_Msg):
    request_id: str
    #: The caller's prompt, or what this stage's input function made of upstream outputs.
    prompt: Any
    #: The request's resolved params for this stage (:func:`omni_runtime.params.resolve_params`:
    #: a tagged params struct, every default in force filled in), as the runner reads them.
    params: P
    #: Upstream outputs: ``text`` and named arrays / tensors.
    inputs: dict[str, Any] = {}
    #: When the caller submitted it (``time.time()``), for end-to-end metrics.
    arrival_time: float = 0.0
    #: Higher first (aged: see omni_runtime/stage/scheduler.py); under step execution a request of
    #: higher priority also takes a running one's place at a step boundary.
    priority: int = 0


class StageAbort(msgspec.Struct, tag="abort", **_Msg):
    request_ids: list[str]


class StageRpc(msgspec.Struct, tag="rpc", **_Msg):
    call_id: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class StageShutdown(msgspec.Struct, tag="shutdown", **_Msg):
    pass


class StagePing(msgspec.Struct, tag="ping", **_Msg):
    """Liveness probe; answered with :class:`StagePong` from the worker's event loop."""

    seq: int


WorkerInbound = StageRequest | StageAbort | StageRpc | StageShutdown | StagePing


# --------------------------------------------------------------------------- worker -> orchestrator


class SpeechBound(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How long a speech stage's clip can get, reported at READY so that a request whose clip
    could pass ``max_seconds`` is refused before it is queued: a clip's memory grows with its
    length (the text-to-frame alignment with its length x its tokens), not with its text alone.

    The stage caps every token's duration at ``token_frames`` (at speed 1), so a text of ``n``
    tokens at ``speed`` makes at most :meth:`longest_s` seconds, whatever the model predicts."""

    #: Longest clip one request may make, in seconds (``engine_args.max_speech_seconds``).
    max_seconds: float
    #: Most spectrogram frames one token lasts at speed 1.
    token_frames: int
    #: Seconds of one spectrogram frame (samples per frame / sample rate).
    frame_s: float
    #: Tokens a text of ``n`` characters makes at most: ``tokens_per_char x n + extra_tokens`` (2 and
    #: 1 where the tokenizer puts a blank between characters); None: the tokenizer can make more
    #: (it romanizes or phonemizes), and only the stage checks, with the tokens it made.
    tokens_per_char: int | None = None
    extra_tokens: int = 0
    #: The ``speed`` range the stage takes (an external program's rate limits); None: any.
    speeds: tuple[float, float] | None = None

    def longest_s(self, tokens: int, speed: float) -> float:
        """The longest clip ``tokens`` tokens make at ``speed``: each lasts at most
        ``ceil(token_frames / speed)`` frames (one more, so that float round-off cannot pass it)."""
        return tokens * (int(self.token_frames / speed) + 1) * self.frame_s


class TextBound(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """How many tokens a text stage's request may take, reported at READY so that a request that
    cannot fit is refused before it is queued, not by the stage after its wait.

    The prompt and the answer (``max_tokens``) share the model's ``context``. Only the stage's
    tokenizer knows a prompt's tokens exactly; where it is a byte-level BPE (every token stands for
    at most ``bytes_per_token`` bytes of the text), :meth:`fewest_tokens` bounds them from below from
    the characters, so that the caller refuses only a prompt that cannot fit however it is
    tokenized, and the stage checks the rest with the tokens it made."""

    #: Tokens the model attends over, prompt and answer together (its ``max_position_embeddings``);
    #: None: the model does not say.
    context: int | None = None
    #: Most tokens one request may generate (``engine_args.max_output_tokens``); None: no bound but
    #: the context (and ``max_tokens``' own range).
    max_tokens: int | None = None
    #: Most bytes of the prompt (UTF-8, after ``normalization``) that one token stands for; None:
    #: the tokenizer is not a byte-level BPE, and the prompt's tokens are not bounded from its text.
    bytes_per_token: int | None = None
    #: The Unicode normalization the tokenizer applies before it splits the text, or None.
    normalization: Literal["NFC", "NFD", "NFKC", "NFKD"] | None = None
    #: Texts the tokenizer makes one token of wherever a prompt holds them (its special tokens).
    special_tokens: tuple[str, ...] = ()
    #: Tokens every prompt gets besides its text's (a BOS, a template's); an empty prompt is one token.
    extra_tokens: int = 0

    def fewest_tokens(self, prompt: str) -> int | None:
        """The fewest tokens the stage's tokenizer can make of ``prompt``, or None when it cannot be
        told from the text. Each special token the prompt holds is taken to cover its bytes in one
        token, and every other token at most ``bytes_per_token`` bytes of what is left."""
        if self.bytes_per_token is None:
            return None
        text = unicodedata.normalize(self.normalization, prompt) if self.normalization else prompt
        size = len(text.encode("utf-8", "surrogatepass"))
        special = sum(len(s.encode()) * max(prompt.count(s), text.count(s)) for s in self.special_tokens if s)
        return max(1, self.extra_tokens + -(-max(size - special, 0) // self.bytes_per_token))

    @property
    def shortest_prompt(self) -> int:
        """Tokens of the shortest prompt (an empty one)."""
        return max(1, self.extra_tokens)


class StageConstraints(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """What a stage's loaded model allows, reported in its READY message and checked by the caller
    before enqueue (:func:`omni_runtime.params.check_constraints`). Every field's default checks
    nothing; a runner that names a field this struct lacks fails at load, not silently."""

    #: Height and width must be multiples of it (the VAE scale factor, latent packing, patch size).
    size_multiple: int | None = None
    #: Why, in the model's terms, for the error.
    size_multiple_reason: str | None = None
    #: Most pixels (height x width) a request may ask for.
    max_pixels: int | None = None
    #: Longest height or width (a denoiser's positional table: past it the model fails), and why.
    max_side: int | None = None
    max_side_reason: str | None = None
    #: The (height, width) the model was made for, named in the ``max_pixels`` error.
    native_size: tuple[int, int] | None = None
    #: Whether the model takes LoRA adapters; a stage that does not say so refuses them.
    lora: bool = False
    #: The step counts the model's scheduler runs (found at load by running it)...
    min_inference_steps: int | None = None
    max_inference_steps: int | None = None
    #: ...and the scheduler's name, for the error.
    inference_steps_reason: str | None = None
    #: Which of ``image`` / ``mask_image`` the stage takes (empty: none).
    image_inputs: tuple[str, ...] = ()
    #: Why an image input is not taken, for the error.
    image_inputs_note: str | None = None
    #: The pipelines' own default ``strength`` per form (``image``, ``inpaint``), so that a request
    #: is checked to run at least one denoising step.
    default_strength: dict[str, float] = {}
    #: Set (to the reason) when the pipeline only edits images: a request needs an input image.
    requires_image: str | None = None
    #: A video model makes ``frames_step * k + 1`` frames; None: the stage makes images, and
    #: ``num_frames`` / ``fps`` are refused.
    frames_step: int | None = None
    #: Why, in the model's terms, for the error.
    frames_reason: str | None = None
    #: Most frames a request may ask for.
    max_frames: int | None = None
    #: Most ``num_frames x height x width`` a video request may ask for (``engine_args.max_video_pixels``).
    max_video_pixels: int | None = None
    #: The longest clip (seconds) an audio model makes; None: the stage makes no audio, and
    #: ``audio_end_in_s`` / ``audio_start_in_s`` / ``num_waveforms_per_prompt`` are refused.
    max_audio_s: float | None = None
    #: Why, in the model's terms, for the error.
    audio_reason: str | None = None
    #: The longest input audio (seconds) a speech-recognition stage takes in one request (its
    #: model's window); None: the stage takes no audio, and ``audio`` is refused.
    max_input_audio_s: float | None = None
    #: Why, in the model's terms, for the error.
    input_audio_reason: str | None = None
    #: The voices a speech stage takes (its speakers' names and the aliases mapped onto them);
    #: empty: any (the stage checks).
    voices: tuple[str, ...] = ()
    #: How long a speech stage's clip can get; None: the stage makes no speech.
    speech: SpeechBound | None = None
    #: How many tokens a text stage's request may take (its model's context, its
    #: ``engine_args.max_output_tokens``); None: the stage makes no text.
    text: TextBound | None = None
    #: Most codes a decoder stage (``omni_code2wav``) takes in one request or one chunk (its DiT's
    #: positions / repeats); None: the stage takes no codes.
    max_input_codes: int | None = None
    #: Most codes a request may ask a talker stage to make (``max_codes``): set by the engine from
    #: the ``max_input_codes`` of the stage the talker feeds, where that stage takes the codes whole
    #: (or in chunks larger than that); None: not bounded here.
    max_codes: int | None = None
    #: Why, for the error.
    max_codes_reason: str | None = None
    #: The step-cache types a request's ``cache`` may name (empty: none); None: not checked here.
    cache_types: tuple[str, ...] | None = None
    #: Why other types are refused, for the error.
    cache_note: str | None = None


class BatchProfileReport(msgspec.Struct, **_Msg):
    """The start-up profile of one replica: what it timed, how long it took, and the fit it gave."""

    #: The profiled key, summarised (as the cost model's metrics label); "" when nothing was timed.
    key: str
    seconds: float
    #: Forwards timed, per batch size (in the order timed).
    forwards: dict[int, int]
    #: The fitted line (ms), or None when the profile gave too little evidence for one.
    fixed_ms: float | None = None
    per_item_ms: float | None = None
    #: Why the profile stopped short or did not run (``max_s``, no representative request...).
    note: str | None = None


class StageReady(msgspec.Struct, tag="ready", **_Msg):
    stage_id: int
    replica_id: int
    pid: int
    #: Checks the caller makes before enqueue (``size_multiple``, ``max_pixels``...).
    constraints: StageConstraints = msgspec.field(default_factory=StageConstraints)
    #: What the start-up profile of the cost of a batch measured (``engine_args.batch_profile``).
    batch_profile: BatchProfileReport | None = None
    #: Seconds the load spent compiling (``torch_compile: {warmup: true}``), paid before READY
    #: rather than by the first request; None: no compile warm-up ran.
    compile_s: float | None = None


class Progress(msgspec.Struct, **_Msg):
    """How far a request's denoising got: ``step`` of ``steps`` done."""

    step: int
    steps: int


class StageMetrics(msgspec.Struct, **_Msg):
    """What a stage reports about how it served one request; None where it does not say.

    Made in one place from the dict the worker and its runner fill (:meth:`of`), and turned back
    into the plain dict callers read as ``OmniRequestOutput.metrics`` in one place
    (:meth:`as_dict`): a key a runner of its own reports beyond these lands in ``extra``."""

    #: From arrival at the stage to admission into a wave (ms).
    queue_wait_ms: float | None = None
    #: From admission to the start of its wave's forward (ms).
    admission_wait_ms: float | None = None
    #: The forward's wall time (ms); under step execution, from admission to the last step.
    execution_ms: float | None = None
    #: Requests in its wave (under step execution: the largest step batch it was in).
    batch_size: int | None = None
    batch_id: int | None = None
    replica_id: int | None = None
    #: The seed of its generator (diffusion, text sampling).
    seed: int | None = None
    #: When the stage finished with it (``time.time()``), to place the stage's spans in a trace.
    finished_at: float | None = None
    #: From the start of its forward to the end of its first denoising step (ms).
    first_step_ms: float | None = None
    #: From arrival at the stage to the end of its first denoising step (ms).
    time_to_first_step_ms: float | None = None
    #: The VAE decode of its wave (ms).
    decode_ms: float | None = None
    #: Step execution: the steps it ran, and how often a higher priority paused it.
    steps_run: int | None = None
    pauses: int | None = None
    #: Text stages: tokens of the prompt and of the answer.
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    #: Set by the orchestrator on a delivered output: from the caller's submit to delivery (ms).
    e2e_ms: float | None = None
    #: Whatever else a runner reported, by name.
    extra: dict[str, Any] = {}

    @classmethod
    def of(cls, metrics: dict[str, Any]) -> StageMetrics:
        """The struct of a runner's / worker's metrics dict. A key it does not declare, or a value
        of another type than its field's (which the receiver could not decode), goes to ``extra``
        as it is; None is a value not reported."""
        known: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in metrics.items():
            kind = _METRIC_TYPES.get(key)
            if value is None and kind is not None:
                continue
            if kind is not None and isinstance(value, kind) and not isinstance(value, bool):
                known[key] = value
            else:
                extra[key] = value
        return cls(**known, extra=extra) if extra else cls(**known)

    def as_dict(self) -> dict[str, Any]:
        """The metrics a stage reported, as callers read them (``OmniRequestOutput.metrics``)."""
        out = {k: v for k in _METRIC_TYPES if (v := getattr(self, k)) is not None}
        out.update(self.extra)
        return out


#: Each declared metric and the Python types its values may have (int fields take only ints).
_METRIC_TYPES: dict[str, type | tuple[type, ...]] = {
    f.name: int if f.type == (int | None) else (int, float)
    for f in msgspec.structs.fields(StageMetrics)
    if f.name != "extra"
}


class Payload(msgspec.Struct, **_Msg):
    """What a stage made for one request: a whole output, or a streamed piece of one. The same
    object travels from the stage to the caller (the orchestrator wraps it, never copies it).

    A partial output (``finished=False``) is a text delta, a :class:`Progress` event, or the
    notice that an inner (not final) stage is done with the request (``stage_done``, with that
    stage's metrics); a consumer tells them apart by these fields, never by metrics keys."""

    text: str | None = None
    #: Images (and, as kinds are added, video and audio): see omni_runtime/media.py.
    media: list[MediaItem] = []
    #: Named arrays or tensors (``latents``, ``prompt_embeds``, float ``images``...).
    tensors: dict[str, Any] = {}
    #: How the stage served the request (on a final output and on a stage-done notice).
    metrics: StageMetrics = msgspec.field(default_factory=StageMetrics)
    #: Set on a progress event: the step the request just finished.
    progress: Progress | None = None
    #: True on the notice that an inner stage is done with the request.
    stage_done: bool = False


class StageOutput(msgspec.Struct, tag="output", **_Msg):
    request_id: str
    #: False for a partial output (a text delta); True once this stage is done with the request.
    finished: bool = True
    payload: Payload = msgspec.field(default_factory=Payload)
    error: ErrorInfo | None = None


class StageOutputs(msgspec.Struct, tag="outputs", **_Msg):
    """Every output of one wave, in one message (one send, one wake-up of the orchestrator)."""

    outputs: list[StageOutput]


class StageRpcResult(msgspec.Struct, tag="rpc_result", **_Msg):
    call_id: int
    result: Any = None
    error: ErrorInfo | None = None


class StagePong(msgspec.Struct, tag="pong", **_Msg):
    seq: int
    #: Seconds since the running forward last made progress (a step, a streamed piece); None
    #: when no forward runs. A forward stuck in native code shows here while pongs keep coming.
    stalled_s: float | None = None


class StageStartupFailed(msgspec.Struct, tag="startup_failed", **_Msg):
    """The replica could not load its model; it exits after sending this instead of READY."""

    error: ErrorInfo


WorkerOutbound = StageReady | StageOutput | StageOutputs | StageRpcResult | StagePong | StageStartupFailed


# --------------------------------------------------------------------------- caller <-> orchestrator


class EngineRequest(msgspec.Struct, tag="request", **_Msg):
    request_id: str
    #: The caller's output channel (one per event loop that uses the engine).
    channel: int
    prompt: Any
    #: Resolved params per stage id: each stage's params struct (``omni_runtime.params``), sent
    #: on to the stage as it is.
    params: dict[int, Any]
    #: The final stages this caller wants (a subset of the config's, e.g. for ``modalities``).
    final_stage_ids: list[int]
    arrival_time: float
    #: Absolute ``time.monotonic()`` deadline, or None.
    deadline: float | None = None
    #: Higher is served first (every stage's scheduler).
    priority: int = 0
    #: Open for streaming updates (:class:`EngineUpdate`): the prompt is the first piece of the
    #: input, each source stage takes it chunk by chunk, and it ends with the final update.
    streaming_input: bool = False
    #: The stages the prompt enters at, in place of the pipeline's sources (checked by the caller).
    entry_stage_ids: list[int] | None = None


class EngineUpdate(msgspec.Struct, tag="update", **_Msg):
    """More input for a request opened with ``streaming_input`` (``add_streaming_update``)."""

    request_id: str
    #: Text appended to the request's input.
    text: str | None = None
    #: Named values that go with the next chunk the source stage gets (its ``inputs``).
    inputs: dict[str, Any] = {}
    #: The last update: the input is complete.
    final: bool = False


class EngineAbort(msgspec.Struct, tag="abort", **_Msg):
    request_ids: list[str]
    #: The error the caller gets (``RequestAbortedError`` unless said otherwise).
    reason: ErrorInfo | None = None


class EngineRpc(msgspec.Struct, tag="rpc", **_Msg):
    call_id: int
    channel: int
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    stage_ids: list[int] | None = None
    timeout: float | None = None


class EngineShutdown(msgspec.Struct, tag="shutdown", **_Msg):
    pass


EngineInbound = EngineRequest | EngineUpdate | EngineAbort | EngineRpc | EngineShutdown


class EngineOutput(msgspec.Struct, tag="output", **_Msg):
    request_id: str
    stage_id: int
    #: True on the request's last message: every requested final stage is done (or it failed).
    finished: bool
    #: True when this stage is done with the request (False for a streamed delta).
    stage_finished: bool = True
    payload: Payload = msgspec.field(default_factory=Payload)
    error: ErrorInfo | None = None


class RpcReplicaResult(msgspec.Struct, **_Msg):
    """One replica's answer to a control call."""

    stage_id: int
    replica_id: int
    result: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class EngineRpcResult(msgspec.Struct, tag="rpc_result", **_Msg):
    call_id: int
    results: list[RpcReplicaResult] = []
    #: Set when the call as a whole failed (it could not be sent); ``results`` is then empty.
    error: ErrorInfo | None = None


class EngineDead(msgspec.Struct, tag="dead", **_Msg):
    """The engine can no longer serve: every request still pending on this channel ends with
    ``error``. Sent after the outputs that came before the death, so none overtakes them."""

    error: ErrorInfo


EngineOutbound = EngineOutput | EngineRpcResult | EngineDead
