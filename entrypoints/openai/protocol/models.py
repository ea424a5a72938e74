"""``/v1/models`` (what each served model is and does) and the control call
``POST /v1/omni/collective_rpc``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from .common import Timeout, _Request


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "omni_runtime"
    #: What the model makes (its final stages' output types: image, video, audio, text), so that a
    #: client (the playground) offers the right parameters.
    kinds: list[str] = []
    #: The ``/v1/generate`` tasks it serves (``text2image``, ``text2video``, ``image2video``,
    #: ``text2audio``, ``text2speech``).
    tasks: list[str] = []
    #: Every task it serves, routes included (``image_edit``, ``image_variation``, ``chat``...):
    #: a route for another task answers 400 naming ``model``.
    serves: list[str] = []
    #: The voices its speech stage takes, once loaded (empty: any, or no speech).
    voices: list[str] = []
    #: Whether a request may carry audio (a first stage that recognises speech): a realtime
    #: session's spoken turns are answered.
    audio_input: bool = False
    #: Where the model is: loading, loaded, failed (its requests fail with a 503 naming it), dead.
    state: str = "loaded"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CollectiveRpcRequest(_Request):
    """``POST /v1/omni/collective_rpc``: a control call on every replica of the chosen stages."""

    method: str = Field(min_length=1, max_length=128)
    args: list[Any] = Field(default_factory=list, max_length=64)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    stage_ids: list[int] | None = Field(None, max_length=256)
    timeout: Timeout | None = None
    #: The model to call (an unloaded or asleep one is brought back first); None: every loaded
    #: model when several are served (the results then say whose), else the only one.
    model: str | None = Field(None, max_length=256)


class ReplicaResult(BaseModel):
    #: Whose replica, when several models are served.
    model: str | None = None
    stage_id: int
    replica_id: int
    ok: bool
    result: Any = None
    error: str | None = None
