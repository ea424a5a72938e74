"""What the engine checks of a call in the caller's thread, before anything is queued.

Bad input is a typed error at the call site (:class:`InvalidRequestError` naming the field): that
includes anything no message could carry (a lone surrogate, an integer past 64 bits), which would
otherwise fail inside the orchestrator thread that serves everyone. A request is checked once,
completely: its prompt, every stage's params (defaults applied, within what each stage's model
allows, as its replicas reported it in READY) and the outputs it asks for; a :class:`ValidRequest`
is then generated as it is. The checks here read the stages' constraints as the engine passes them
at each call, so a call sees what the stages reported last.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from omni_runtime.checks import bounded_defaults, check_constraints, check_speech_length, check_text_length
from omni_runtime.config import DeployConfig, check_control_kwargs
from omni_runtime.engine.stage_graph import StageGraph
from omni_runtime.exceptions import InvalidRequestError
from omni_runtime.media import output_type
from omni_runtime.messages import StageConstraints
from omni_runtime.params import MAX_PROMPT_CHARS, resolve_params
from omni_runtime.resolve import ResolvedConfig
from omni_runtime.serialization import check_encodable

#: Longest request id accepted, in characters.
MAX_REQUEST_ID_CHARS = 256
#: Longest control-call timeout accepted, in seconds.
MAX_RPC_TIMEOUT_S = 86_400.0
#: The constraints of a stage that reported none (checks nothing).
NO_CONSTRAINTS = StageConstraints()


@dataclass(frozen=True)
class ValidRequest:
    """A request that passed validation (:meth:`AsyncOmniEngine.validate`): generate it without
    checking it again. Valid for the engine that made it only."""

    prompt: str
    #: Resolved params per stage id (defaults applied, validated, encodable), as dicts of the
    #: fields that are set (``params_to_dict`` of ``typed``): what a caller reads of them.
    params: dict[int, dict[str, Any]]
    final_stage_ids: list[int]
    #: The request's deadline in seconds, or None.
    timeout: float | None
    engine_id: str
    #: Higher is served first by every stage's scheduler.
    priority: int = 0
    #: The same params as each stage's runner gets them: its params struct, sent as it is.
    typed: dict[int, Any] = field(default_factory=dict)
    #: The stages the prompt enters at (None: the pipeline's sources).
    entry_stage_ids: list[int] | None = None


def check_prompt(prompt: Any) -> str:
    """A prompt: a string of at most ``MAX_PROMPT_CHARS`` characters that a message can carry."""
    if not isinstance(prompt, str):
        raise InvalidRequestError(f"prompt must be a string, got {type(prompt).__name__}", param="prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidRequestError(
            f"prompt is {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}", param="prompt"
        )
    check_encodable(prompt, "prompt")
    return prompt


def resolve_stage_params(
    resolved: ResolvedConfig, constraints: Mapping[int, StageConstraints], sampling_params: Any
) -> dict[int, Any]:
    """Per-stage params structs, validated, defaults applied (the stage's, then its params
    class's fallbacks), checked against each stage's ``constraints``.

    Accepts None, one params object or dict (for a one-stage pipeline, or a typed object for
    the stages of its type), or a list with one entry per stage in ``stage_args`` order.
    """
    stages = resolved.stages
    if sampling_params is None:
        given: list[Any] = [None] * len(stages)
    elif isinstance(sampling_params, list | tuple):
        if len(sampling_params) != len(stages):
            raise InvalidRequestError(
                f"sampling_params_list has {len(sampling_params)} entries; this pipeline has "
                f"{len(stages)} stages (one entry per stage, None for defaults)",
                param="sampling_params_list",
            )
        given = list(sampling_params)
    elif len(stages) == 1:
        given = [sampling_params]
    elif isinstance(sampling_params, msgspec.Struct):
        given = [sampling_params if isinstance(sampling_params, s.params_cls) else None for s in stages]
        if not any(g is not None for g in given):
            raise InvalidRequestError(
                f"no stage of this pipeline takes {type(sampling_params).__name__}", param="sampling_params"
            )
    else:
        raise InvalidRequestError(
            "this pipeline has several stages: pass sampling_params_list with one entry per stage",
            param="sampling_params_list",
        )
    typed_params = {}
    for stage, params in zip(stages, given, strict=True):
        limits = constraints.get(stage.stage_id, NO_CONSTRAINTS)
        # A length the request leaves to the stage is the stage's default within its bounds.
        defaults = bounded_defaults(stage.params_cls, stage.defaults, limits)
        typed = resolve_params(stage.params_cls, defaults, params)
        check_constraints(typed, limits)
        typed_params[stage.stage_id] = typed
    return typed_params


def check_prompt_lengths(
    resolved: ResolvedConfig,
    constraints: Mapping[int, StageConstraints],
    prompt: str,
    params: dict[int, dict[str, Any]],
) -> None:
    """The prompt within the speech and text bounds of each stage that takes the prompt itself."""
    for stage in resolved.stages:
        if not stage.config.engine_input_source:
            limits = constraints.get(stage.stage_id, NO_CONSTRAINTS)
            check_speech_length(prompt, params[stage.stage_id], limits)
            check_text_length(prompt, params[stage.stage_id], limits)


def final_stages(config: DeployConfig, modalities: Sequence[str] | None) -> list[int]:
    """Final stage ids for the requested output modalities (None = all final outputs)."""
    finals = [s for s in config.stage_args if s.final_output]
    if modalities is None:
        return [s.stage_id for s in finals]
    if isinstance(modalities, str) or not isinstance(modalities, Sequence):
        raise InvalidRequestError("modalities must be a list of strings", param="modalities")
    if not all(isinstance(m, str) for m in modalities):
        raise InvalidRequestError("modalities must be a list of strings", param="modalities")
    wanted = {output_type(m) for m in modalities}
    chosen = [s.stage_id for s in finals if s.final_output_type in wanted]
    if not chosen:
        # A final stage has a type (checked at load).
        available = sorted({s.final_output_type for s in finals if s.final_output_type is not None})
        check_encodable(sorted(wanted), "modalities")
        raise InvalidRequestError(
            f"no final stage produces {sorted(wanted)}; this pipeline offers {available}", param="modalities"
        )
    return chosen


def chosen_stages(config: DeployConfig, stages: Any) -> list[int]:
    """The stages a caller asked to answer with (``validate(stages=...)``): distinct ids of the
    config's stages, any of them (a stage inside the pipeline answers with its own output, and only
    the stages it needs run)."""
    known = {s.stage_id for s in config.stage_args}
    if isinstance(stages, str | bytes) or not isinstance(stages, Sequence) or not stages:
        raise InvalidRequestError("stages must be a non-empty list of stage ids", param="stages")
    for stage_id in stages:
        if isinstance(stage_id, bool) or not isinstance(stage_id, int) or stage_id not in known:
            raise InvalidRequestError(
                f"stages: no stage {repr(stage_id)[:40]} in this pipeline; its stages are {sorted(known)}",
                param="stages",
            )
    if len(set(stages)) != len(stages):
        raise InvalidRequestError("stages: each stage id once", param="stages")
    return list(stages)


def check_entry_stages(config: DeployConfig, graph: StageGraph, entries: Any, finals: Sequence[int]) -> list[int]:
    """The stages a caller's prompt enters at (``validate(entry_stages=...)``), in place of the
    pipeline's sources: the stages upstream of them do not run. Each final stage must be fed from
    them, and every stage that runs must have all of its inputs from stages that run."""
    ids = chosen_stages(config, entries)  # distinct ids of the pipeline
    runs: set[int] = set()
    for entry in ids:
        fed = graph.fed_by(entry)
        if fed & set(ids):
            raise InvalidRequestError(
                f"entry_stages: stage {min(fed & set(ids))} is fed by stage {entry}, also an entry",
                param="entry_stages",
            )
        runs |= fed | {entry}
    for final in finals:
        if final not in runs:
            raise InvalidRequestError(
                f"entry_stages: stage {final} (a final stage of this request) is not fed from stages {ids}",
                param="entry_stages",
            )
    for sid in sorted(runs & graph.needed(finals) - set(ids)):
        missing = [src for src in graph.stage(sid).engine_input_source if src not in runs]
        if missing:
            raise InvalidRequestError(
                f"entry_stages: stage {sid} also takes the output of stage {missing[0]}, which does not run "
                f"when the prompt enters at {ids}",
                param="entry_stages",
            )
    return ids


def check_request_id(request_id: Any) -> str:
    """A caller's request id: a non-empty string of at most ``MAX_REQUEST_ID_CHARS`` characters."""
    if not isinstance(request_id, str) or not request_id or len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(
            f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_CHARS} characters",
            param="request_id",
        )
    check_encodable(request_id, "request_id")
    return request_id


def check_update(text: Any, inputs: Any) -> None:
    """A streaming update's ``text`` (a string of at most ``MAX_PROMPT_CHARS``, or None) and
    ``inputs`` (a mapping, or None), both such that a message can carry them."""
    if text is not None and not isinstance(text, str):
        raise InvalidRequestError(f"`text` must be a string, got {type(text).__name__}", param="text")
    if text is not None and len(text) > MAX_PROMPT_CHARS:
        raise InvalidRequestError(
            f"text is {len(text)} characters; the limit of one update is {MAX_PROMPT_CHARS}", param="text"
        )
    if inputs is not None and not isinstance(inputs, dict):
        raise InvalidRequestError(f"`inputs` must be a mapping, got {type(inputs).__name__}", param="inputs")
    check_encodable(text, "text")
    check_encodable(inputs or {}, "inputs")


def check_rpc(
    config: DeployConfig,
    method: Any,
    args: Any,
    kwargs: Any,
    stage_ids: Any,
    timeout: Any,
) -> dict[str, Any]:
    """A control call's arguments; returns its keyword arguments, a built-in call's checked
    against the deploy YAML's bounds (``set_batching``: ``max_num_seqs``...)."""
    if not isinstance(method, str) or not method or len(method) > 256:
        raise InvalidRequestError("method must be a non-empty string of at most 256 characters", param="method")
    check_encodable(method, "method")
    if isinstance(args, str | bytes) or not isinstance(args, Sequence):
        raise InvalidRequestError(f"args must be a list, got {type(args).__name__}", param="args")
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise InvalidRequestError("kwargs must be a mapping with string keys", param="kwargs")
    check_encodable(list(args), "args")
    check_encodable(dict(kwargs or {}), "kwargs")
    checked = check_control_kwargs(method, dict(kwargs or {}), prefix="kwargs.")
    if stage_ids is not None:
        if isinstance(stage_ids, str | bytes) or not isinstance(stage_ids, Sequence):
            raise InvalidRequestError("stage_ids must be a list of stage ids", param="stage_ids")
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in stage_ids):
            raise InvalidRequestError("stage_ids must be a list of integers", param="stage_ids")
        unknown = set(stage_ids) - {s.stage_id for s in config.stage_args}
        if unknown:
            shown = sorted(unknown)[:8]
            raise InvalidRequestError(f"unknown stage id(s) {shown}", param="stage_ids")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or not 0 < timeout <= MAX_RPC_TIMEOUT_S
    ):
        raise InvalidRequestError(f"timeout must be a number of seconds in (0, {MAX_RPC_TIMEOUT_S:g}]", param="timeout")
    return checked
