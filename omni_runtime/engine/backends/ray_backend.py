"""The ``ray`` backend: each replica is a Ray actor (:mod:`omni_runtime.stage.ray_actor`),
placed anywhere on a Ray cluster by the resources its stage asks for.

Opt-in: the process backend stays the default (on one machine it is about ten times cheaper
per message and starts in a second instead of ten). Everything above the backend is unchanged:
the pool's routing, restarts with backoff and heartbeats, the scheduler, batching, abort,
deadlines and control calls.

* **Messages**: msgspec bytes both ways. A call of ``handle(frames, refs)`` per message to the
  actor; one long-lived streaming generator per replica brings back everything it says.
* **Arrays**: an actor stores large output arrays in Ray's object store and sends their refs.
  An output that goes on to exactly one Ray stage is handed over as refs (actor to actor, through
  the object store, never through this process); anyone else gets values, fetched here without
  blocking the loop.
* **Faults**: an actor that dies ends its stream at once (``ActorDiedError``): the replica's
  requests fail with StageDeadError and the pool restarts it, possibly on another node. A node
  that is lost stops answering pings, and the pool kills and replaces its replicas after
  ``heartbeat_timeout_s`` (Ray itself notices only after its own health checks, ~15 s); the
  orphaned actor exits by itself once it hears nothing.
* **Placement**: ``runtime.resources`` (``{"GPU": 1}``, custom node resources) and
  ``runtime.placement`` (``spread`` | ``pack``). A placement no node can ever satisfy fails
  start-up at once, naming the stage and what is missing (Ray itself would wait forever); one that
  waits for capacity fails after ``startup_timeout_s``.
* **Declared models**: a node joined with ``omni-runtime worker --models sdxl,flux --tags a100``
  offers ``omni_model:sdxl``, ``omni_model:flux`` and ``omni_tag:a100`` (:func:`declared_resources`).
  While any live node declares a model when an engine starts (or always, with
  ``runtime.require_declared_model: true``), each replica of its ray stages needs
  ``omni_model:<the served model name>``, and ``runtime.tags`` add ``omni_tag:<tag>``: a model runs
  only on the nodes that declare it. A model no live node declares fails its start at once, naming
  it; one whose declaring nodes are all lost later has its replicas ``unplaced`` (its requests fail
  at once) until such a node joins again and the pool places them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
from functools import partial
from typing import Annotated, Any, Literal

import msgspec

from omni_runtime.config import DeployConfig, StageConfig
from omni_runtime.exceptions import (
    ConfigError,
    StageDeadError,
    StageExecutionError,
    StageStartupError,
    StageUnplacedError,
)
from omni_runtime.messages import StageOutput, StageReady, StageStartupFailed
from omni_runtime.serialization import Encoder, outbound_decoder, remote_arrays, replace_remote
from omni_runtime.stage.ray_actor import StageActor

from . import ray_connection
from .base import EngineResources, OnDead, OnMessage, StageBackend, StageClient
from .ray_connection import ray_module

logger = logging.getLogger(__name__)

#: The node resource saying a node holds a model (``omni_model:sdxl``), and one naming a tag.
MODEL_RESOURCE_PREFIX = "omni_model:"
TAG_RESOURCE_PREFIX = "omni_tag:"
#: How much of each model or tag resource a declaring node offers; a replica takes 1. The count is
#: no real limit (CPUs, GPUs and memory are): it only says "this node may host that model".
DECLARED_CAPACITY = 1000.0
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")


def resource_name(kind: Literal["model", "tag"], name: str) -> str:
    """The node resource for the model or tag ``name``; ConfigError naming it when it cannot be
    one (letters, digits, ``. _ / -``, starting with a letter or digit, at most 128)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"invalid {kind} name {name!r}: expected letters, digits, '.', '_', '/' or '-', "
            "starting with a letter or digit, at most 128 characters"
        )
    return (MODEL_RESOURCE_PREFIX if kind == "model" else TAG_RESOURCE_PREFIX) + name


def declared_resources(models: list[str], tags: list[str]) -> dict[str, float]:
    """The node resources a worker holding ``models`` and tagged ``tags`` offers."""
    names = [resource_name("model", m) for m in models] + [resource_name("tag", t) for t in tags]
    return dict.fromkeys(names, DECLARED_CAPACITY)


#: Seconds between checks, while an actor waits to be placed, that a node can still host it.
_PLACE_CHECK_S = 2.0


def _declares() -> bool:
    """Whether any live node of the cluster declares a model (blocking)."""
    nodes = ray_module().nodes()
    return any(
        n.get("Alive") and any(k.startswith(MODEL_RESOURCE_PREFIX) for k in n.get("Resources", {})) for n in nodes
    )


class RayOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``runtime:`` keys only the ``ray`` backend reads."""

    #: Ray resources each replica needs, e.g. ``{"GPU": 1}`` or a custom node resource
    #: ``{"stage_node_a": 1}`` (``CPU`` defaults to 1).
    resources: dict[str, Annotated[float, msgspec.Meta(ge=0)]] = msgspec.field(default_factory=dict)
    #: ``spread`` the replicas over the nodes, or ``pack`` them (Ray's default).
    placement: Literal["spread", "pack"] = "pack"
    #: The cluster to join: ``auto`` (the one this machine belongs to), a ``host:port`` /
    #: ``ray://`` address, or ``local`` (start one in this process). Every ray stage of a config
    #: must name the same; ``Omni(..., ray_address=...)`` and ``serve --ray-address`` set it for
    #: all of them.
    ray_address: str = "auto"
    #: With ``ray_address: local``: the directory the local cluster keeps its sessions in (logs,
    #: sockets), kept when the cluster stops. Unset: a fresh ``omr-ray-*`` directory under the
    #: system temp dir, removed when the last engine of the process closes. Keep it short: Ray's
    #: socket paths in it must fit 107 bytes.
    ray_temp_dir: str | None = None
    #: Arrays at least this large travel through Ray's object store (handed from actor to
    #: actor); smaller ones ride in the message, as each stored object costs a few ms.
    object_store_min_bytes: Annotated[int, msgspec.Meta(ge=0)] = 1 << 20
    #: Seconds an actor that hears nothing from the engine (its node lost touch) waits before it
    #: exits by itself, freeing its node. Unset: ``max(10, 3 * heartbeat_timeout_s)``; keep it
    #: well above ``heartbeat_timeout_s``. Never used when heartbeats are off.
    orphan_timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    #: Whether each replica needs a node declaring this model (``omni-runtime worker --models``):
    #: ``true`` always, ``false`` never, unset when any live node of the cluster declares a model
    #: as the engine starts (decided once per engine).
    require_declared_model: bool | None = None
    #: Node tags each replica needs (``omni-runtime worker --tags``), e.g. ``[a100]``.
    tags: list[str] = msgspec.field(default_factory=list)


def ray_options(stage: StageConfig) -> RayOptions:
    """The ray settings of ``stage`` (their defaults for a stage of another backend)."""
    options = stage.runtime.options
    return options if isinstance(options, RayOptions) else RayOptions()


class RayBackend(StageBackend):
    name = "ray"
    options = RayOptions

    @classmethod
    def check_stages(cls, stages: list[StageConfig]) -> list[str]:
        # One process joins one Ray cluster.
        errors = []
        for field, what in (("ray_address", "clusters"), ("ray_temp_dir", "temp dirs")):
            values = {str(getattr(ray_options(s), field)) for s in stages}
            if len(values) > 1:
                errors.append(f"the ray stages name different {what}: {sorted(values)}")
        return errors

    def __init__(self, config: DeployConfig, resources: EngineResources) -> None:
        super().__init__(config, resources)
        stages = [s for s in config.stage_args if s.runtime.backend == self.name]
        first = ray_options(stages[0]) if stages else RayOptions()
        self.address = first.ray_address
        self.temp_dir = first.ray_temp_dir
        #: Connecting is part of starting: bounded like the slowest stage's start.
        self.connect_timeout_s = max((s.runtime.startup_timeout_s for s in stages), default=300.0)
        self._actor_class: Any = None
        #: The model name this engine's replicas need a node to declare (None: no such need).
        self.declared_model: str | None = None
        #: Bytes of arrays this process fetched from the object store (hand-offs move none).
        self.fetched_bytes = 0

    async def open(self) -> None:
        ray = ray_module()
        # The connection is the process's, shared with its other engines: this engine holds one
        # use of it and gives that back on close (only the last user disconnects). Blocking: off
        # this loop.
        await asyncio.get_running_loop().run_in_executor(
            None, ray_connection.acquire, self.address, self.connect_timeout_s, self.temp_dir
        )
        self.resources.add("ray connection (one use)", ray_connection.release)
        self._actor_class = ray.remote(StageActor)
        stages = [s for s in self.config.stage_args if s.runtime.backend == self.name]
        wanted = {ray_options(s).require_declared_model for s in stages}
        if True in wanted or (None in wanted and await asyncio.get_running_loop().run_in_executor(None, _declares)):
            name = self.config.model or "omni"
            try:
                resource_name("model", name)
            except ConfigError as e:
                raise StageStartupError(f"the model {name!r} cannot be declared by a Ray node: {e}") from None
            self.declared_model = name

    def client(
        self, stage: StageConfig, replica_id: int, generation: int, on_message: OnMessage, on_dead: OnDead
    ) -> StageClient:
        return RayStageClient(stage, replica_id, generation, on_message, on_dead, self)

    def settle(self, out: StageOutput, consumer: StageConfig | None) -> Any:
        refs = remote_arrays(out)
        if not refs or (consumer is not None and consumer.runtime.backend == self.name):
            return out  # nothing to fetch, or handed over as refs to the next actor
        return self._fetch(out, refs)

    async def _fetch(self, out: StageOutput, refs: list[Any]) -> StageOutput:
        try:
            arrays = await asyncio.gather(*(r.handle for r in refs))
        except Exception as e:
            err = StageExecutionError(f"output lost: its arrays could not be fetched ({type(e).__name__}: {e})")
            raise err from e
        self.fetched_bytes += sum(getattr(a, "nbytes", 0) for a in arrays)
        return replace_remote(out, {id(r): r.value(a) for r, a in zip(refs, arrays, strict=True)})

    def _env(self, stage: StageConfig) -> dict[str, str]:
        # The actor imports what this process can (runners named ``module:Class``), and its torch
        # uses the threads the stage asked for, or the CPUs Ray gives it.
        cpus = ray_options(stage).resources.get("CPU", 1)
        threads = str(stage.runtime.torch_threads or max(1, int(cpus)))
        return {
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            "TRANSFORMERS_VERBOSITY": "error",
        }

    def actor_options(self, stage: StageConfig) -> dict[str, Any]:
        settings = ray_options(stage)
        resources = dict(settings.resources)
        if self.declared_model is not None and settings.require_declared_model is not False:
            resources[resource_name("model", self.declared_model)] = 1
        for tag in settings.tags:
            resources[resource_name("tag", tag)] = 1
        options: dict[str, Any] = {
            "num_cpus": resources.pop("CPU", 1),
            "num_gpus": resources.pop("GPU", 0),
            "resources": resources,
            "max_restarts": 0,  # the pool restarts, with its own backoff and placement
            "max_task_retries": 0,
            "max_concurrency": 1000,  # an async actor: calls interleave at awaits
            "runtime_env": {"env_vars": self._env(stage)},
        }
        if ray_options(stage).placement == "spread":
            options["scheduling_strategy"] = "SPREAD"
        return options

    def wanted(self, stage: StageConfig) -> dict[str, float]:
        """The Ray resources one replica of ``stage`` holds while it lives."""
        options = self.actor_options(stage)
        wanted = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], **options["resources"]}
        return {k: v for k, v in wanted.items() if v}

    def infeasible(self, stage: StageConfig) -> str | None:
        """Why no node of the cluster can ever host a replica of ``stage`` (None: one can)."""
        ray = ray_module()
        wanted = self.wanted(stage)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        for node in nodes:
            have = node.get("Resources", {})
            if all(have.get(k, 0) >= v for k, v in wanted.items()):
                return None
        best = {k: max((n.get("Resources", {}).get(k, 0) for n in nodes), default=0) for k in wanted}
        missing = {k: v for k, v in wanted.items() if best[k] < v}
        undeclared = [k for k in missing if k.startswith((MODEL_RESOURCE_PREFIX, TAG_RESOURCE_PREFIX))]
        if undeclared:
            models = [k.removeprefix(MODEL_RESOURCE_PREFIX) for k in undeclared if k.startswith(MODEL_RESOURCE_PREFIX)]
            tags = [k.removeprefix(TAG_RESOURCE_PREFIX) for k in undeclared if k.startswith(TAG_RESOURCE_PREFIX)]
            said = [f"the model `{m}`" for m in models] + [f"the tag `{t}`" for t in tags]
            hint = " ".join([f"--models {','.join(models)}"] * bool(models) + [f"--tags {','.join(tags)}"] * bool(tags))
            return (
                f"no live node of the Ray cluster declares {' and '.join(said)} (join one with "
                f"`omni-runtime worker --address HEAD {hint}`); a replica needs {wanted}"
            )
        return (
            f"no node of the Ray cluster has the resources a replica needs: {wanted} "
            f"(missing {missing or wanted}; the largest node offers {best})"
        )


class RayStageClient(StageClient):
    """One replica as a Ray actor."""

    def __init__(
        self,
        stage: StageConfig,
        replica_id: int,
        generation: int,
        on_message: OnMessage,
        on_dead: OnDead,
        backend: RayBackend,
    ) -> None:
        super().__init__(stage, replica_id, on_message, on_dead)
        self._backend = backend
        self._generation = generation
        self._actor: Any = None
        self._reader: asyncio.Task | None = None
        self._closing = False
        self._encoder = Encoder()
        self._decoder = outbound_decoder()
        self.node: str | None = None
        self._pid: int | None = None
        self._reported = False
        self._resource: int | None = None
        self._killing: asyncio.Future | None = None

    @property
    def pid(self) -> int | None:
        return self._pid

    async def start(self) -> StageReady:
        ray = ray_module()
        loop = asyncio.get_running_loop()
        stage = self.stage
        why = await loop.run_in_executor(None, self._backend.infeasible, stage)
        if why is not None:
            raise StageUnplacedError(f"stage {self.stage_id} replica {self.replica_id} cannot be placed: {why}")
        options = self._backend.actor_options(stage)
        heartbeat = stage.runtime.heartbeat_timeout_s
        settings = ray_options(stage)
        orphan = settings.orphan_timeout_s or max(10.0, 3 * heartbeat)
        self._actor = self._backend._actor_class.options(**options).remote(
            msgspec.to_builtins(stage),
            self.replica_id,
            orphan_timeout_s=orphan if heartbeat else 0.0,
            remote_min_bytes=settings.object_store_min_bytes,
        )
        token = self._backend.resources.add(
            f"stage {self.stage_id} replica {self.replica_id} (ray actor)", partial(ray.kill, self._actor)
        )
        timeout = stage.runtime.startup_timeout_s
        deadline = loop.time() + timeout
        try:
            # 1) placed: the actor answers its first call once a node had its resources free (Ray
            #    itself would wait silently forever)  2) loaded: READY, within the same bound.
            try:
                self.node = await self._placed(timeout)
            except TimeoutError:
                raise StageStartupError(
                    f"replica {self.replica_id} of stage {self.stage_id} waits for resources "
                    f"{self._backend.wanted(stage)}: no node of the Ray cluster had them free within {timeout:g} s "
                    "(runtime.startup_timeout_s; other replicas or programs hold them)"
                ) from None
            try:
                frames, refs = await asyncio.wait_for(self._actor.start.remote(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                raise StageStartupError(
                    f"stage {self.stage_id} replica {self.replica_id} (placed on Ray node {self.node}) did not "
                    f"load its model within {timeout:g} s (runtime.startup_timeout_s)"
                ) from None
            msg = self._decoder.decode(frames, refs)
            if isinstance(msg, StageStartupFailed):
                raise StageStartupError(
                    f"stage {self.stage_id} replica {self.replica_id} failed to load: {msg.error.message}"
                )
            self.ready = msg
            self._pid = msg.pid
        except BaseException as e:
            self._backend.resources.discard(token)
            await self._kill_actor()
            if isinstance(e, Exception) and not isinstance(e, StageStartupError):
                raise StageStartupError(
                    f"stage {self.stage_id} replica {self.replica_id} could not start: {type(e).__name__}: {e}"
                ) from e
            raise
        self._resource = token
        self.alive = True
        gen = self._actor.outputs.options(num_returns="streaming").remote()
        self._reader = loop.create_task(self._read(gen), name=f"ray-stage{self.stage_id}r{self.replica_id}")
        return self.ready

    async def _placed(self, timeout: float) -> str:
        """The node the actor was placed on, within ``timeout`` (TimeoutError). StageUnplacedError
        as soon as no live node can host it any more (its node was lost before the actor ran):
        waiting would only end at the time-out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        where = asyncio.ensure_future(self._actor.node.remote())
        try:
            while True:
                left = deadline - loop.time()
                done, _ = await asyncio.wait([where], timeout=max(0.0, min(left, _PLACE_CHECK_S)))
                if done:
                    return str(where.result())
                if left <= _PLACE_CHECK_S:
                    raise TimeoutError
                why = await loop.run_in_executor(None, self._backend.infeasible, self.stage)
                if why is not None:
                    raise StageUnplacedError(f"stage {self.stage_id} replica {self.replica_id} cannot be placed: {why}")
        finally:
            where.cancel()

    async def _read(self, gen: Any) -> None:
        """Everything the actor says, in order, until it dies (which is reported once)."""
        try:
            async for ref in gen:
                frames, refs = await ref
                try:
                    msg = self._decoder.decode(frames, refs)
                except msgspec.DecodeError as e:
                    self._unreadable(frames, e)
                    continue
                self._on_message(self, msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            reason = f"stage {self.stage_id} replica {self.replica_id} (ray actor on node {self.node}) died: {e}"
            self._report_dead(reason.splitlines()[0])

    def send(self, msg: Any) -> None:
        if not self.alive or self._actor is None:
            raise StageDeadError(
                f"stage {self.stage_id} replica {self.replica_id} is not alive", stage_id=self.stage_id
            )
        frames = self._encoder.encode(msg)  # msgspec.EncodeError: nothing was sent
        # Submitting a call does not wait for it; the actor answers through its stream.
        self._actor.handle.remote([bytes(f) for f in frames], list(self._encoder.remote))

    def kill(self, reason: str) -> None:
        if self.alive:
            self._killing = asyncio.ensure_future(self._kill_actor())
            self._report_dead(reason)

    def _report_dead(self, reason: str) -> None:
        """Once per replica, whichever noticed first (the stream, a failed send, a heartbeat)."""
        self.alive = False
        if not self._closing and not self._reported:
            self._reported = True
            logger.error("%s", reason)
            self._on_dead(self, reason)

    async def _kill_actor(self) -> None:
        if self._actor is not None:
            ray = ray_module()
            # ray.kill is a blocking call to the cluster: off the loop.
            await asyncio.get_running_loop().run_in_executor(None, lambda: ray.kill(self._actor, no_restart=True))

    async def close(self, timeout: float = 5.0) -> None:
        self._closing = True
        self.alive = False
        if self._actor is not None:
            try:
                await asyncio.wait_for(self._actor.stop.remote(), timeout)
            except Exception:
                pass  # dead already, or unresponsive: killed below either way
            await self._kill_actor()
            self._backend.resources.discard(self._resource)
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
