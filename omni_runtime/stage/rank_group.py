"""A replica as a group of rank processes that run every model call in lock step (``runtime.parallel``).

Rank 0 is the replica the engine knows: its stage process, worker and scheduler are the usual
ones (READY, requests, control calls and outputs go through it alone). The other ranks are forked
by its stage process as it starts, while it has one thread (:func:`prefork`: a replica forked from
the stage launcher passes on the libraries it imported, so a group start pays no imports); each
waits for its arguments, and dies with rank 0. Rank 0's runner is wrapped in a
:class:`GroupLeader`, which at load hands the followers their arguments, forms the
``torch.distributed`` group with them (a TCP store on a free loopback port, ``gloo`` on the CPU,
``nccl`` on CUDA) and applies the
stage's parallelism to every rank's pipeline (:mod:`omni_runtime.stage.parallel`). Then each
runner call that computes (``execute``, the ``step_*`` calls, ``sleep``/``wake_up``, every
``rpc_*`` control call) is first sent to the followers (msgpack over ZMQ: no pickle) with
everything that decides its course filled in (a seed for each unseeded request), then run here,
so that every rank makes the same denoiser calls in the same order and meets the others in
their collectives.

What could make ranks part ways is settled by rank 0 alone: each abort check a runner makes
during a call is rank 0's answer, broadcast (:class:`LeaderContext`, :class:`FollowerContext`);
after each call the ranks agree on whether it failed. A rank that dies, a collective that waits
past ``collective_timeout_s`` (a peer stopped or hung) or ranks that disagree end the whole
group at once: rank 0 exits, the engine fails its requests with StageDeadError and restarts the
replica, which starts a new group. Nothing of the group outlives rank 0: the followers die with
it (``PR_SET_PDEATHSIG``), their sockets are loopback TCP (no files) and they map no shared
memory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from typing import Any, Generic, TypeVar

import msgspec

from omni_runtime.config import StageConfig, rank_devices
from omni_runtime.config_types import ParallelConfig
from omni_runtime.logs import configure_logging
from omni_runtime.messages import StageRequest
from omni_runtime.serialization import Decoder, Encoder
from omni_runtime.stage.lifetime import die_with_parent
from omni_runtime.stage.optional_imports import keep_out_unrequested
from omni_runtime.stage.runners.base import ExecuteContext, RunnerRequest, runner_class

logger = logging.getLogger("omni_runtime.stage")

P = TypeVar("P")

#: Exit code of a rank 0 whose group broke (EX_SOFTWARE, as a replica whose loop died).
GROUP_BROKEN = 70
#: Runner calls every rank makes (besides every ``rpc_*`` control call).
MIRRORED = frozenset({"execute", "step_admit", "step_run", "step_drop", "sleep", "wake_up"})
#: Calls whose first argument is a list of requests, and those that take an ExecuteContext last.
_WITH_REQUESTS = frozenset({"execute", "step_admit"})
_WITH_CONTEXT = frozenset({"execute", "step_admit", "step_run"})


class GroupCall(msgspec.Struct, Generic[P], kw_only=True, tag="call"):
    """One runner call, from rank 0 to the other ranks."""

    method: str
    requests: list[StageRequest[P]] = []
    ids: list[str] = []
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class FollowerArgs(msgspec.Struct, kw_only=True, frozen=True):
    """What rank 0 hands a forked follower on its pipe (msgpack)."""

    stage: Any  # StageConfig as builtins
    replica_id: int
    rank: int
    world_size: int
    device: str
    store_port: int
    commands_addr: str
    status_addr: str
    log_level: int


class FollowerStatus(msgspec.Struct, kw_only=True, frozen=True):
    """A follower's word at start-up: its model is loaded, or why it is not."""

    rank: int
    error: str | None = None


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _init_group(store: Any, rank: int, world_size: int, device: str, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        _backend(device), store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )


def _bound_collectives(timeout_s: float) -> None:
    """Every process group of this rank (the group's, and those its device mesh and diffusers
    made) waits at most ``timeout_s`` in a collective from now on. The groups form with the
    start-up bound: connecting four ranks on a loaded machine can take longer than a step."""
    import torch.distributed.distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        c10d._set_pg_timeout(timedelta(seconds=timeout_s), group)


def broadcast_flag(value: bool) -> bool:
    """Rank 0's ``value`` on every rank (what a follower passes is ignored)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if value else 0], dtype=torch.uint8, device=_collective_device())
    dist.broadcast(flag, 0)
    return bool(flag.item())


def agree(failed: bool) -> bool:
    """Whether every rank's call ended the same way (all failed, or none did)."""
    import torch
    import torch.distributed as dist

    count = torch.tensor([1 if failed else 0], dtype=torch.int32, device=_collective_device())
    dist.all_reduce(count)
    return int(count.item()) in (0, dist.get_world_size())


def _collective_device() -> Any:
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


class LeaderContext(ExecuteContext):
    """Rank 0's context of a mirrored call: the worker's, whose abort answers are broadcast."""

    def __init__(self, inner: ExecuteContext) -> None:
        super().__init__(inner.is_aborted, inner.emit, inner.step_progress)

    def is_aborted(self, request_id: str) -> bool:
        return broadcast_flag(super().is_aborted(request_id))


class FollowerContext(ExecuteContext):
    """A follower's context: rank 0's abort answers; nothing emitted (rank 0 sends the outputs)."""

    def __init__(self) -> None:
        super().__init__(lambda rid: False)

    def is_aborted(self, request_id: str) -> bool:
        return broadcast_flag(False)


def _with_seed(request: RunnerRequest) -> RunnerRequest:
    """``request`` with a seed of its own, drawn here if it had none: every rank must draw the
    same noise. (The seed is reported back in its output, as a fresh one always is.)"""
    params = request.params
    if getattr(params, "seed", 0) is not None:
        return request
    return dataclasses.replace(request, params=msgspec.structs.replace(params, seed=secrets.randbelow(2**32)))


def _wire(request: RunnerRequest) -> StageRequest:
    return StageRequest(
        request_id=request.request_id,
        prompt=request.prompt,
        params=request.params,
        inputs=request.inputs,
        priority=request.priority,
    )


def _runner_request(msg: StageRequest) -> RunnerRequest:
    return RunnerRequest(
        request_id=msg.request_id, prompt=msg.prompt, params=msg.params, inputs=dict(msg.inputs), priority=msg.priority
    )


def _broken(reason: str, closing: bool = False) -> None:
    """The group can no longer run in lock step: end this process now (its followers die with
    it); the engine sees the replica exit and restarts it. Nothing else is safe: the forward
    thread may be inside a collective that will never return. While the replica shuts down (its
    followers stopped on purpose), the call just fails."""
    if closing:
        raise RuntimeError(f"the parallel group is closing: {reason}")
    logger.critical("parallel group broken: %s", reason)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(GROUP_BROKEN)


def apply(runner: Any, parallel: ParallelConfig, device: str) -> str:
    # lazy: imports torch and diffusers, which only a loaded diffusion runner needs.
    from omni_runtime.stage.parallel import apply_parallelism

    return apply_parallelism(runner.pipe, parallel, device)


class ForkedRank:
    """A follower forked from rank 0 before rank 0 started any thread (:func:`prefork`): it waits
    for its :class:`FollowerArgs` on a pipe. Rank 0's handle of it: ``pid``, ``poll``, ``wait``
    (it reaps it), ``kill``."""

    def __init__(self, pid: int, args_fd: int) -> None:
        self.pid = pid
        self.args_fd: int | None = args_fd
        self.returncode: int | None = None

    def send_args(self, payload: bytes) -> None:
        fd, self.args_fd = self.args_fd, None
        assert fd is not None
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
        except BrokenPipeError:
            pass  # it died already: its exit says so
        finally:
            os.close(fd)

    def _reaped(self, flags: int) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, flags)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reaped(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while deadline is not None and self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        code = self._reaped(0)
        assert code is not None
        return code

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


#: Followers forked by :func:`prefork` for this process's replica, taken by its GroupLeader.
_PREFORKED: list[ForkedRank] = []


def prefork(stage: dict[str, Any]) -> None:
    """In a stage process whose stage is a parallel group, before it starts any thread: fork the
    followers now, with the libraries this process has imported (a replica forked from the stage
    launcher has torch and diffusers), so that a group start or restart does not pay their
    imports again. Each waits for its arguments from the GroupLeader's load."""
    parallel = (stage.get("runtime") or {}).get("parallel") or {}
    world = int(parallel.get("ulysses_degree", 1)) * int(parallel.get("ring_degree", 1))
    world *= int(parallel.get("cfg_parallel_size", 1))
    parent = os.getpid()
    for _ in range(1, world):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the follower
            code = 70
            try:
                # Only its own pipe's read end: a sibling's write end held here would keep that
                # sibling from ever seeing the end of its arguments.
                for sibling in _PREFORKED:
                    if sibling.args_fd is not None:
                        os.close(sibling.args_fd)
                _PREFORKED.clear()
                os.close(write)
                _die_with(parent)
                code = _forked_follower(read)
            finally:
                os._exit(code)
        os.close(read)
        _PREFORKED.append(ForkedRank(pid, write))


def _forked_follower(args_fd: int) -> int:
    chunks = []
    while chunk := os.read(args_fd, 1 << 16):
        chunks.append(chunk)
    os.close(args_fd)
    if not chunks:
        return 0  # rank 0 closed without a group (it failed before its load)
    return _follower_main(msgspec.msgpack.decode(b"".join(chunks), type=FollowerArgs))


class GroupLeader:
    """Rank 0's runner: the stage's own, whose computing calls every rank makes in lock step.
    Every other attribute is the runner's."""

    def __init__(self, runner: Any, stage: StageConfig, replica_id: int) -> None:
        assert stage.runtime.parallel is not None
        self.runner = runner
        self.stage = stage
        self.parallel: ParallelConfig = stage.runtime.parallel
        self.replica_id = replica_id
        self.devices = rank_devices(stage.runtime, replica_id)
        self.followers: list[ForkedRank] = []
        self._pushes: list[Any] = []
        self._encoder = Encoder(None)
        self._closing = False
        self.applied = ""

    def __getattr__(self, name: str) -> Any:
        if name in MIRRORED or name.startswith("rpc_"):
            method = getattr(self.runner, name)  # AttributeError: the runner has no such call
            return partial(self._mirror, name, method)
        return getattr(self.runner, name)

    def stats(self) -> dict[str, Any]:
        """The runner's stats, and the group's: its size, each rank's pid, what was applied."""
        pids = [os.getpid(), *(p.pid for p in self.followers)]
        return {
            **self.runner.stats(),
            "parallel": {"world_size": self.parallel.world_size, "rank_pids": pids, "applied": self.applied},
        }

    # ------------------------------------------------------------------ load

    def load(self) -> None:
        """Start the other ranks, load the model here while they load theirs, form the group and
        apply the parallelism on every rank. Raises (a load failure, with a rank's reason) if a
        rank fails or the group does not form within the start-up bound."""
        import torch.distributed as dist
        import zmq

        world = self.parallel.world_size
        if len(_PREFORKED) != world - 1:
            raise RuntimeError(
                f"a group of {world} ranks needs {world - 1} followers forked by its stage process at its start "
                f"(omni_runtime.stage.process); {len(_PREFORKED)} were"
            )
        self.runner.device = self.devices[0]
        timeout = self.parallel.collective_timeout_s
        startup = self.stage.runtime.startup_timeout_s
        store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=startup), wait_for_workers=False)
        ctx: Any = zmq.Context.instance()
        status = ctx.socket(zmq.PULL)
        status.setsockopt(zmq.LINGER, 0)
        status.bind("tcp://127.0.0.1:*")
        status_addr = status.getsockopt_string(zmq.LAST_ENDPOINT)
        for rank in range(1, world):
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.setsockopt(zmq.SNDHWM, 0)
            push.bind("tcp://127.0.0.1:*")
            self._pushes.append(push)
            args = FollowerArgs(
                stage=msgspec.to_builtins(self.stage),
                replica_id=self.replica_id,
                rank=rank,
                world_size=world,
                device=self.devices[rank],
                store_port=store.port,
                commands_addr=push.getsockopt_string(zmq.LAST_ENDPOINT),
                status_addr=status_addr,
                log_level=logging.getLogger("omni_runtime").getEffectiveLevel(),
            )
            proc = _PREFORKED.pop(0)
            proc.send_args(msgspec.msgpack.encode(args))
            self.followers.append(proc)
        deadline = time.monotonic() + startup
        try:
            self.runner.load()
            self._await_followers(status, deadline)
        finally:
            status.close(linger=0)
        setup = max(timeout, deadline - time.monotonic())
        _init_group(store, 0, world, self.devices[0], setup)
        self.applied = apply(self.runner, self.parallel, self.devices[0])
        dist.barrier()
        _bound_collectives(timeout)
        logger.info(
            "stage %d replica %d: a group of %d ranks (pids %s); %s",
            self.stage.stage_id,
            self.replica_id,
            world,
            ", ".join(str(pid) for pid in [os.getpid(), *(p.pid for p in self.followers)]),
            self.applied,
        )
        threading.Thread(target=self._watch, name="rank-group-watch", daemon=True).start()

    def _await_followers(self, status: Any, deadline: float) -> None:
        """Each follower's word that its model is loaded; the first failure (its reason, or its
        exit) or the deadline raises."""
        decoder = msgspec.msgpack.Decoder(FollowerStatus)
        waiting = set(range(1, len(self.followers) + 1))
        while waiting:
            if status.poll(100):
                word = decoder.decode(status.recv())
                if word.error is not None:
                    raise RuntimeError(f"rank {word.rank} failed to load: {word.error}")
                waiting.discard(word.rank)
                continue
            for rank in sorted(waiting):
                code = self.followers[rank - 1].poll()
                if code is not None:
                    raise RuntimeError(f"rank {rank} exited with code {code} before it loaded")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank(s) {sorted(waiting)} did not load in time")

    def _watch(self) -> None:
        """A follower that exits ends the group (rank 0 with it)."""
        fds = {os.pidfd_open(p.pid): rank for rank, p in enumerate(self.followers, start=1)}
        ready, _, _ = select.select(list(fds), [], [])
        rank = fds[ready[0]]
        code = self.followers[rank - 1].wait()
        if not self._closing:
            _broken(f"rank {rank} (pid {self.followers[rank - 1].pid}) exited with code {code}")

    # ------------------------------------------------------------------ lock step

    def _mirror(self, name: str, method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        # Positional-only: a control call's own keywords (add_lora's ``name``) pass through.
        import torch.distributed as dist

        args_list = list(args)
        call: GroupCall = GroupCall(method=name)
        if name in _WITH_REQUESTS:
            args_list[0] = [_with_seed(r) for r in args_list[0]]
            call.requests = [_wire(r) for r in args_list[0]]
        elif name in ("step_run", "step_drop"):
            call.ids = list(args_list[0])
        else:
            call.args, call.kwargs = args_list, dict(kwargs)
        if name in _WITH_CONTEXT:
            args_list[-1] = LeaderContext(args_list[-1])
        frames = self._encoder.encode(call)  # an EncodeError: nothing was sent, the call fails here
        for push in self._pushes:
            push.send_multipart(frames, copy=False)
        error: BaseException | None = None
        result = None
        try:
            result = method(*args_list, **kwargs)
            if name == "wake_up":  # a fresh pipeline: the parallelism again
                apply(self.runner, self.parallel, self.devices[0])
        except BaseException as e:
            error = e
        if isinstance(error, dist.DistError):
            _broken(f"{name}: {error}", self._closing)
        try:
            same = agree(error is not None)
        except Exception as e:
            _broken(f"{name}: the ranks did not meet after it: {e}", self._closing)
        if not same:
            _broken(f"{name}: it failed on some ranks only ({error!r} here)", self._closing)
        if error is not None:
            raise error
        return result

    def close(self) -> None:
        """Stop the followers (they would die with this process anyway), before the forward
        thread they are tied to ends; a call still running then fails instead of ending the
        process."""
        self._closing = True
        for proc in self.followers:
            if proc.poll() is None:
                proc.kill()
        for proc in self.followers:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                logger.error("rank pid %d did not exit after SIGKILL", proc.pid)


# ---------------------------------------------------------------------------- a follower


def _die_with(parent_pid: int) -> None:
    die_with_parent()
    if os.getppid() != parent_pid:  # rank 0 died before the line above
        os._exit(1)


def follow(args: FollowerArgs) -> int:
    """A follower's life: load, join the group, then run what rank 0 sends until it goes."""
    import zmq

    stage = msgspec.convert(args.stage, StageConfig)
    stage = msgspec.structs.replace(stage, runtime=msgspec.structs.replace(stage.runtime, devices=args.device))
    parallel = stage.runtime.parallel
    assert parallel is not None
    keep_out_unrequested([stage])
    ctx = zmq.Context()
    status = ctx.socket(zmq.PUSH)
    status.setsockopt(zmq.LINGER, 2000)
    status.connect(args.status_addr)
    commands = ctx.socket(zmq.PULL)
    commands.setsockopt(zmq.RCVHWM, 0)
    commands.connect(args.commands_addr)
    encode = msgspec.msgpack.encode
    try:
        runner = runner_class(stage.stage_type)(stage)
        runner.replica_id = args.replica_id
        runner.load()
    except Exception as e:
        logger.exception("rank %d failed to load", args.rank)
        status.send(encode(FollowerStatus(rank=args.rank, error=f"{type(e).__name__}: {e}")))
        status.close()
        return 1
    status.send(encode(FollowerStatus(rank=args.rank)))
    import torch.distributed as dist

    # The group forms within the start-up bound; its collectives then wait collective_timeout_s.
    setup = max(parallel.collective_timeout_s, stage.runtime.startup_timeout_s)
    store = dist.TCPStore("127.0.0.1", args.store_port, args.world_size, False, timeout=timedelta(seconds=setup))
    _init_group(store, args.rank, args.world_size, args.device, setup)
    apply(runner, parallel, args.device)
    dist.barrier()
    _bound_collectives(parallel.collective_timeout_s)
    decoder = Decoder(GroupCall[runner.params_cls])  # type: ignore[name-defined]  # the runner's class
    while True:
        call = decoder.decode(commands.recv_multipart(copy=False))
        error: BaseException | None = None
        try:
            _run(runner, call, parallel, args)
        except Exception as e:
            error = e
        if isinstance(error, dist.DistError) or not agree(error is not None):
            logger.critical("rank %d: %s failed apart from rank 0: %r", args.rank, call.method, error)
            return GROUP_BROKEN


def _run(runner: Any, call: GroupCall, parallel: ParallelConfig, args: FollowerArgs) -> None:
    if call.method in _WITH_REQUESTS:
        getattr(runner, call.method)([_runner_request(r) for r in call.requests], FollowerContext())
    elif call.method == "step_run":
        runner.step_run(call.ids, FollowerContext())
    elif call.method == "step_drop":
        runner.step_drop(call.ids)
    elif call.method in MIRRORED or call.method.startswith("rpc_"):
        getattr(runner, call.method)(*call.args, **call.kwargs)
        if call.method == "wake_up":
            apply(runner, parallel, args.device)
    else:
        raise ValueError(f"not a group call: {call.method!r}")


def _follower_main(args: FollowerArgs) -> int:
    """A forked follower, from its arguments to its exit code (its streams flushed)."""
    # Its thread counts and ignored SIGINT are rank 0's, set before the fork.
    stage_id = args.stage["stage_id"]
    configure_logging(
        args.log_level,
        f"%(asctime)s %(levelname)s stage{stage_id}.{args.replica_id} rank{args.rank} %(name)s: %(message)s",
    )
    code = follow(args)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code
