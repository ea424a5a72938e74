"""Entry point of a stage replica process (forked by the launcher, or spawned): ``run_stage_process``.

The parent binds two ZMQ sockets in a private directory (or on loopback) and passes their
addresses; this process connects, loads the model, says READY, then serves until it is told to
shut down or its parent dies (``PR_SET_PDEATHSIG``: no orphans even if the parent is SIGKILLed).
This module is the ZMQ and shared-memory transport; start-up, lost inputs and the worker are the
:class:`~omni_runtime.stage.replica_host.ReplicaHost`'s, as for a Ray actor.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Any

import msgspec

from omni_runtime.logs import configure_logging
from omni_runtime.stage.lifetime import die_with_parent

logger = logging.getLogger("omni_runtime.stage")


class StageProcessArgs(msgspec.Struct, kw_only=True, frozen=True):
    """What the parent hands a new stage process (msgpack bytes: nothing is pickled)."""

    stage: Any  # StageConfig as builtins
    replica_id: int
    inbound_addr: str
    outbound_addr: str
    torch_threads: int
    log_level: int = logging.INFO
    #: Name prefix of this replica's shared-memory pool (``ipc`` only; None: arrays as frames).
    shm_prefix: str | None = None
    #: The engine's segment prefix: handles in inbound messages must name segments under it.
    shm_engine: str | None = None


def run_stage_process(args_bytes: bytes) -> None:
    """Process target. Exit code 0 after a clean shutdown."""
    die_with_parent()
    args = msgspec.msgpack.decode(args_bytes, type=StageProcessArgs)
    # Ctrl-C goes to the whole process group; the parent decides how to shut stages down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Thread counts before torch is imported: several processes x all cores is several times slower.
    threads = str(args.torch_threads)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = threads
    if "torch" in sys.modules:  # forked from the launcher, which imported it already
        sys.modules["torch"].set_num_threads(args.torch_threads)
    # The runtime's lines at the engine's level, the libraries' warnings only at debug; before any
    # library is imported (they read their level as they are), and replacing the launcher's setup
    # in a forked replica.
    configure_logging(
        args.log_level,
        f"%(asctime)s %(levelname)s stage{args.stage['stage_id']}.{args.replica_id} %(name)s: %(message)s",
    )
    # A parallel group's other ranks are forked now, while this process has one thread.
    # lazy: the rank group's module imports numpy, after the thread counts above.
    from omni_runtime.stage.rank_group import prefork

    prefork(args.stage)
    # torch reads OMP_NUM_THREADS when a runner first imports it; a stage that never needs torch
    # (echo, custom runners) does not pay for importing it.
    import uvloop

    code = uvloop.run(_serve(args))
    # Everything this process owns is closed by now (sockets, shared memory, the runner). Ending
    # here skips the interpreter's teardown, which with torch and diffusers loaded takes longer
    # than the whole shutdown (about 1.6 s of a 1.7 s close for a tiny-sd stage): engines,
    # servers and restarts wait on this exit. atexit handlers do not run: a runner frees what it
    # holds in its own close path, as the worker's shutdown calls it.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


async def _serve(args: StageProcessArgs) -> int:
    import zmq

    # lazy: after run_stage_process set the thread counts and logging, which numpy (and torch,
    # with the runner) read as they load; the engine imports this module for StageProcessArgs.
    from omni_runtime.config import StageConfig
    from omni_runtime.messages import StageShutdown, StageStartupFailed
    from omni_runtime.serialization import Encoder, inbound_decoder
    from omni_runtime.shm import ShmLostError, ShmPool
    from omni_runtime.stage.replica_host import ReplicaHost
    from omni_runtime.transport import SocketReader

    ctx = zmq.Context()
    inbound = ctx.socket(zmq.PULL)
    outbound = ctx.socket(zmq.PUSH)
    for sock in (inbound, outbound):
        # Unbounded queues: a send never blocks the loop (admission is bounded in the engine).
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    inbound.connect(args.inbound_addr)
    outbound.connect(args.outbound_addr)
    # Outputs are this replica's to place in shared memory; the pool is unlinked when it exits
    # (or, after a crash, by the parent, which knows the prefix).
    pool = ShmPool(args.shm_prefix) if args.shm_prefix else None
    encoder = Encoder(pool)

    def send(msg: Any) -> None:
        # Unbounded HWM: never blocks while the parent is connected; NOBLOCK, so that a parent that
        # is gone (this process dies with it, PR_SET_PDEATHSIG) is a dropped message, not a hang.
        # msgspec.EncodeError reaches the worker, which answers the request with an error instead.
        frames = encoder.encode(msg)
        try:
            outbound.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            logger.warning("dropped %s: the parent cannot be reached (%s)", type(msg).__name__, e)

    # A worker whose scheduling loop died would take requests and never answer them: exit
    # non-zero instead, so the parent fails what it held with StageDeadError and restarts it.
    main, fatal = asyncio.current_task(), []
    assert main is not None  # called from a coroutine

    def on_fatal(exc: BaseException) -> None:
        fatal.append(exc)
        main.cancel()

    host = ReplicaHost(msgspec.convert(args.stage, StageConfig), args.replica_id, send, on_fatal)
    try:
        ready = await host.start()
        send(ready)
        if isinstance(ready, StageStartupFailed):
            return 0
        # A request's params decode as the loaded runner's params class, arrays in place.
        decoder = inbound_decoder(args.shm_engine, host.params_cls)
        stopped = asyncio.get_running_loop().create_future()

        def on_frames(frames: list[Any]) -> None:
            try:
                msg = decoder.decode(frames)
            except ShmLostError as e:
                host.input_lost(e.message, e)
                return
            except msgspec.DecodeError as e:
                host.malformed(e)
                return
            if isinstance(msg, StageShutdown):
                if not stopped.done():
                    stopped.set_result(None)
                return
            host.handle(msg)

        reader = SocketReader(inbound, on_frames)
        try:
            await stopped
        finally:
            reader.close()
    except asyncio.CancelledError:
        if not fatal:
            raise
    finally:
        await host.close()
        outbound.close(linger=1000)  # flush what is queued (outputs, a start-up failure)
        inbound.close(linger=0)
        ctx.term()
        if pool is not None:
            pool.close()
    return 70 if fatal else 0  # EX_SOFTWARE


def main() -> None:
    """``python -m omni_runtime.stage.process``: the start-up args arrive as msgpack on stdin."""
    run_stage_process(sys.stdin.buffer.read())


if __name__ == "__main__":
    main()
