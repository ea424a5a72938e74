"""Deploy configuration: the ``stage_args:`` YAML, decoded into typed msgspec Structs.

Decoding validates once, at load: unknown keys, wrong types, out-of-range values and a broken
stage graph are :class:`~omni_runtime.exceptions.ConfigError`\\ s that name the file and the YAML
path, e.g. ``tiny-sd.yaml: stage_args[0].engine_args.max_num_seqs: Expected `int` >= 1, got 0``.

The structs of a stage entry's sections (``runtime:``, ``engine_args:``, ``input_chunking:``) are
declared in :mod:`omni_runtime.config_types` and importable from here too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import msgspec
import yaml

from omni_runtime.acceleration import check_acceleration
from omni_runtime.backend_registry import BACKENDS, backend_options
from omni_runtime.config_types import CONTROL_CALL_FIELDS as CONTROL_CALL_FIELDS
from omni_runtime.config_types import MAX_BUFFERED_CHUNKS as MAX_BUFFERED_CHUNKS
from omni_runtime.config_types import MAX_CHUNK_SIZE as MAX_CHUNK_SIZE
from omni_runtime.config_types import Backend as Backend
from omni_runtime.config_types import BatchProfile as BatchProfile
from omni_runtime.config_types import EngineArgs, InputChunking, RuntimeConfig
from omni_runtime.config_types import MaxNumSeqs as MaxNumSeqs
from omni_runtime.config_types import ParallelConfig as ParallelConfig
from omni_runtime.config_types import PromptCache as PromptCache
from omni_runtime.config_types import RequestBatchMaxWaitMs as RequestBatchMaxWaitMs
from omni_runtime.config_types import ResultCache as ResultCache
from omni_runtime.config_types import TorchCompile as TorchCompile
from omni_runtime.config_types import check_control_kwargs as check_control_kwargs
from omni_runtime.exceptions import ConfigError
from omni_runtime.media import OUTPUT_TYPES, OutputType
from omni_runtime.serialization import find_unencodable
from omni_runtime.stage.runners.stage_types import stage_types

_Struct = {"kw_only": True, "forbid_unknown_fields": True}


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
    first, so a file with several broken stages reports all of them in one ConfigError. A document
    nested past what the checks can walk is a ConfigError too, not a RecursionError."""
    try:
        return _parse_config(data, source)
    except RecursionError:
        raise ConfigError("nested too deeply to check", source=source) from None


def _parse_config(data: Any, source: str) -> DeployConfig:
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
        if s.engine_args.batch_policy == "deadline" and not s.engine_args.step_execution:
            raise ConfigError(
                "batch_policy: deadline orders the steps of step execution (preempting at step "
                "boundaries); set engine_args.step_execution: true, or use batch_policy: learned",
                path=f"stage_args[{i}].engine_args.batch_policy",
                source=source,
            )
        if s.runtime.parallel is not None:
            check_parallel(s, f"stage_args[{i}].runtime", source)
        if s.engine_args.load_format == "dummy" and s.stage_type != "diffusion":
            raise ConfigError(
                f"load_format: dummy builds the components of a diffusers model directory (stage_type diffusion); "
                f"a {s.stage_type} stage loads its own model",
                path=f"stage_args[{i}].engine_args.load_format",
                source=source,
            )
    return config


def rank_devices(runtime: RuntimeConfig, replica_id: int) -> list[str]:
    """The device of each rank of replica ``replica_id``'s group: ``devices`` lists one per rank
    of every replica in order (``cuda:0,cuda:1,cuda:2,cuda:3``: replica 0 on the first two), or
    names one that every rank shares (``cpu``)."""
    world = runtime.parallel.world_size if runtime.parallel is not None else 1
    devices = [d.strip() for d in runtime.devices.split(",")]
    if len(devices) == 1:
        return devices * world
    return devices[replica_id * world : (replica_id + 1) * world]


def check_parallel(s: StageConfig, at: str, source: str) -> None:
    """``runtime.parallel`` of one stage: what a group of ranks can run, or a ConfigError naming
    the key. Checked at load, with no model: what needs the model (a transformer with a
    context-parallel plan) is the replica's load failure."""
    parallel = s.runtime.parallel
    assert parallel is not None

    def fail(message: str, key: str = "parallel") -> ConfigError:
        return ConfigError(message, path=f"{at}.{key}", source=source)

    if s.stage_type != "diffusion":
        raise fail(f"runtime.parallel splits a diffusion model's denoiser; a {s.stage_type} stage runs on one device")
    if s.runtime.backend_name != "process":
        raise fail(
            "a parallel group's ranks are processes started by its replica: "
            f"use backend: process, not {s.runtime.backend_name}"
        )
    if parallel.world_size > 16:
        raise fail(f"a group of {parallel.world_size} ranks (the product of the degrees) is past the limit of 16")
    devices = [d.strip() for d in s.runtime.devices.split(",")]
    kinds = {d.split(":")[0] for d in devices}
    if "" in kinds or not kinds <= {"cpu", "cuda"}:
        raise fail(f"devices of a parallel group are cpu or cuda[:N], got {s.runtime.devices!r}", "devices")
    if len(kinds) > 1:
        raise fail(f"the ranks of a group run on one kind of device, got {s.runtime.devices!r}", "devices")
    wanted = s.runtime.num_replicas * parallel.world_size
    if len(devices) not in (1, wanted):
        raise fail(
            f"{len(devices)} devices for {s.runtime.num_replicas} replica(s) of {parallel.world_size} ranks: "
            f"list {wanted} (one per rank) or one that all share",
            "devices",
        )
    if kinds == {"cuda"} and len(devices) == 1 and parallel.world_size > 1:
        raise fail(f"on cuda each rank needs a GPU of its own: list {wanted} devices, one per rank", "devices")
    if len(devices) > 1 and kinds == {"cuda"} and len(set(devices)) < len(devices):
        raise fail(f"a cuda device is listed twice in {s.runtime.devices!r}: one rank per GPU", "devices")
    if parallel.ring_degree > 1 and kinds == {"cpu"}:
        raise fail(
            "ring attention needs an attention backend that returns the log-sum-exp, which the CPU's "
            "does not: use ulysses_degree on cpu",
            "parallel.ring_degree",
        )
    args = s.engine_args
    for key, value, why in (
        ("torch_compile", args.torch_compile, "a compiled denoiser would trace the group's collectives"),
        ("cache", args.cache, "each rank would decide on its share of the rows alone"),
        ("offload", args.offload, "the ranks' weights are each on their own device already"),
    ):
        if value not in (None, False):
            raise ConfigError(
                f"engine_args.{key} with runtime.parallel is not supported: {why}",
                path=f"{at.removesuffix('.runtime')}.engine_args.{key}",
                source=source,
            )


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
        except RecursionError:
            raise ConfigError("nested too deeply to read (YAML)", source=source) from None
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
