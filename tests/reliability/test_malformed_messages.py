"""Malformed and foreign messages on stage sockets are dropped and logged; nothing crashes.

Two sides of the wire:

* A stage process (``python -m omni_runtime.stage.process``, started here on sockets this test
  binds, so a raw ZMQ PUSH socket talks to the stage's inbound PULL) gets garbage frames, valid
  msgpack of the wrong type, unknown tags, truncated and hostile ``Ext`` payloads; it drops and
  logs each one and then serves a request and a control call, in the same process.
* A running engine's sockets: its private ipc directory is 0700 and holds only its sockets; a
  foreign PUSH connected to a replica's outbound socket (the orchestrator's PULL) delivers garbage
  and well-formed messages that make no sense there, and the engine drops them and keeps serving
  with the same replica; a foreign PUSH cannot talk to the inbound side at all (PUSH-PUSH).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from omni_runtime.exceptions import StageExecutionError
from omni_runtime.messages import (
    ErrorInfo,
    Payload,
    StageOutput,
    StageReady,
    StageRequest,
    StageRpc,
    StageRpcResult,
    StageShutdown,
)
from omni_runtime.params import EchoSamplingParams, resolve_params
from omni_runtime.serialization import Encoder, outbound_decoder
from omni_runtime.stage.process import StageProcessArgs
from tests.conftest import echo_stage, make_config
from tests.reliability.support import close, last, pids, start, status

_pack = msgspec.msgpack.Encoder().encode
Ext = msgspec.msgpack.Ext


def malformed(to_stage: bool) -> dict[str, list[bytes]]:
    """Messages a receiver must drop, by what is wrong with them. Hostile ``Ext`` payloads ride in a
    message of the receiver's own direction (a request to a stage, an output to the engine), so
    they get as far as the array decoding."""

    def _request_with(ext: Ext) -> bytes:
        if to_stage:
            return _pack({"type": "request", "request_id": "bad", "prompt": ext, "params": {}})
        return _pack({"type": "output", "request_id": "bad", "tensors": {"x": ext}})

    rng = random.Random(7)
    encoder = Encoder()
    big = encoder.encode(StageRequest(request_id="big", prompt="p", params={}, inputs={"x": np.zeros(4096)}))
    valid = bytes(encoder.encode(StageRequest(request_id="cut", prompt="a prompt", params={"delay_ms": 1}))[0])
    return {
        "empty frame": [b""],
        "random bytes": [rng.randbytes(64)],
        "reserved msgpack byte": [b"\xc1"],
        "msgpack int": [_pack(42)],
        "msgpack list": [_pack([1, "two", 3.0])],
        "wrong direction (READY)": [bytes(encoder.encode(StageReady(stage_id=0, replica_id=0, pid=1))[0])],
        "wrong direction (output)": [bytes(encoder.encode(StageOutput(request_id="x", payload=Payload(text="t")))[0])],
        "unknown tag": [_pack({"type": "launch", "request_id": "x"})],
        "missing fields": [_pack({"type": "request", "request_id": "x"})],
        "wrong field type": [_pack({"type": "request", "request_id": 7, "prompt": "p", "params": {}})],
        "truncated header": [valid[: len(valid) // 2]],
        "declared 4 GiB string": [b"\xdb\xff\xff\xff\xff"],
        "nested 100k deep": [b"\x91" * 100_000 + b"\x01"],
        "array frame missing": [bytes(big[0])],
        "truncated Ext": [_request_with(Ext(1, b"\x94\xa3<f4"))],
        "unknown Ext code": [_request_with(Ext(99, _pack(("<f4", [2], b"\0" * 8, False))))],
        "Ext frame index out of range": [_request_with(Ext(1, _pack(("<f4", [2], 9, False))))],
        "Ext dtype that numpy parses as Python": [_request_with(Ext(2, _pack((",", [2], b"\0" * 8, False))))],
        "Ext object dtype": [_request_with(Ext(2, _pack(("|O", [1], b"\0" * 8, False))))],
        "Ext shape larger than data": [_request_with(Ext(2, _pack(("<f4", [1 << 40], b"\0" * 8, False))))],
        "Ext shared memory not ours": [
            _request_with(Ext(3, _pack(("omni_rt-1-dead-o-0", 0, 8, 0, "<f4", [2], False))))
        ],
    }


# --------------------------------------------------------------------------- the stage side


class RawStage:
    """A stage process on sockets this test binds: ``push`` reaches its inbound PULL."""

    def __init__(self, log_path: Path) -> None:
        self.dir = tempfile.mkdtemp(prefix="omni_runtime-test-ipc-")
        self.ctx = zmq.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        for sock in (self.push, self.pull):
            sock.setsockopt(zmq.LINGER, 0)
        self.push.bind(f"ipc://{self.dir}/in")
        self.pull.bind(f"ipc://{self.dir}/out")
        stage = make_config([echo_stage()]).stage_args[0]
        args = StageProcessArgs(
            stage=msgspec.to_builtins(stage),
            replica_id=0,
            inbound_addr=f"ipc://{self.dir}/in",
            outbound_addr=f"ipc://{self.dir}/out",
            torch_threads=1,
            log_level=logging.INFO,
        )
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_runtime.stage.process"], stdin=subprocess.PIPE, stderr=self._log, env=env
        )
        self.proc.stdin.write(msgspec.msgpack.encode(args))
        self.proc.stdin.close()
        self.decoder = outbound_decoder()
        self.ready = self.recv(60)
        assert isinstance(self.ready, StageReady) and self.ready.pid == self.proc.pid

    def send(self, frames: list) -> None:
        self.push.send_multipart(frames)

    def recv(self, timeout: float = 5.0):
        assert self.pull.poll(int(timeout * 1000)), "the stage said nothing"
        return self.decoder.decode(self.pull.recv_multipart())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> int:
        try:
            if self.proc.poll() is None:
                self.send(Encoder().encode(StageShutdown()))
                try:
                    self.proc.wait(10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
            return self.proc.wait()
        finally:
            self._log.close()
            self.push.close()
            self.pull.close()
            self.ctx.term()
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def raw_stage(tmp_path):
    stage = RawStage(tmp_path / "stage.log")
    yield stage
    stage.close()


def test_the_stage_drops_and_logs_every_malformed_message_and_keeps_serving(raw_stage, no_leaks):
    garbage = malformed(to_stage=True)
    encoder = Encoder()
    for frames in garbage.values():
        raw_stage.send(frames)
    # In order on one socket: once this is answered, every message above was handled.
    raw_stage.send(encoder.encode(StageRpc(call_id=1, method="ping")))
    reply = raw_stage.recv()
    assert isinstance(reply, StageRpcResult) and reply.call_id == 1 and reply.result["pid"] == raw_stage.proc.pid

    # What the orchestrator sends: the stage's params class, resolved (every default in force set).
    params = resolve_params(EchoSamplingParams, {}, {})
    raw_stage.send(encoder.encode(StageRequest(request_id="ok", prompt="still here", params=params)))
    out = raw_stage.recv()
    assert (
        isinstance(out, StageOutput)
        and out.request_id == "ok"
        and out.payload.text == "still here"
        and out.error is None
    )
    assert raw_stage.proc.poll() is None

    deadline = time.monotonic() + 5  # stderr is written by the stage as it goes
    while raw_stage.log().count("dropped a malformed message") < len(garbage) and time.monotonic() < deadline:
        time.sleep(0.05)
    log = raw_stage.log()
    assert log.count("dropped a malformed message") == len(garbage), log
    assert "Traceback" not in log
    assert raw_stage.close() == 0  # and it still shuts down cleanly


# --------------------------------------------------------------------------- the engine side


@pytest.fixture(scope="module")
async def engine():
    engine = start(echo_stage())
    yield engine
    await close(engine)


def test_the_ipc_directory_is_private_and_holds_only_sockets(engine):
    ipc_dir = engine.engine._orchestrator.backends["process"].ipc_dir
    st = os.stat(ipc_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    names = sorted(os.listdir(ipc_dir))
    assert names == ["s0r0g0-in", "s0r0g0-out"]
    assert all(stat.S_ISSOCK(os.stat(ipc_dir / n).st_mode) for n in names)


def foreign_messages_for_the_engine() -> dict[str, list[bytes]]:
    encoder = Encoder()

    def enc(msg) -> list[bytes]:
        return [bytes(f) for f in encoder.encode(msg)]

    return {
        **{k: v for k, v in malformed(to_stage=False).items() if "direction" not in k},
        "wrong direction (request)": enc(StageRequest(request_id="x", prompt="p", params={})),
        "a second READY": enc(StageReady(stage_id=0, replica_id=0, pid=1)),
        "a reply to no call": enc(StageRpcResult(call_id=10**9, result="?")),
        "an output for no request": enc(StageOutput(request_id="nobody", payload=Payload(text="boo"))),
        "an error for no request": enc(
            StageOutput(request_id="nobody", error=ErrorInfo(type="StageDeadError", message="boo"))
        ),
    }


async def test_foreign_messages_on_the_engine_sockets_are_dropped(engine, caplog):
    caplog.set_level(logging.WARNING, logger="omni_runtime")
    ipc_dir = engine.engine._orchestrator.backends["process"].ipc_dir
    before = await pids(engine)
    ctx = zmq.Context()
    try:
        to_orchestrator, to_inbound = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
        for sock in (to_orchestrator, to_inbound):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # writable only once a peer completed the handshake
        to_orchestrator.connect(f"ipc://{ipc_dir}/s0r0g0-out")
        to_inbound.connect(f"ipc://{ipc_dir}/s0r0g0-in")  # a PUSH bound there: the handshake refuses us
        assert to_orchestrator.poll(5000, zmq.POLLOUT) == zmq.POLLOUT
        messages = foreign_messages_for_the_engine()
        for frames in messages.values():
            to_orchestrator.send_multipart(frames)
        # PUSH meets PUSH: the handshake never completes, so nothing can be sent that way.
        assert to_inbound.poll(200, zmq.POLLOUT) == 0
        # Requests interleaved with more garbage: each gets its own answer.
        for i in range(20):
            to_orchestrator.send_multipart([os.urandom(32)])
            out = await asyncio.wait_for(last(engine, f"through-{i}"), 5)  # a deaf replica would hang here
            assert out.text == f"through-{i}"
    finally:
        ctx.destroy(linger=0)

    assert await pids(engine) == before
    s = status(engine)
    assert (s.live_replicas, s.restarts, s.inflight) == (1, 0, 0)
    dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) >= len(messages) - 3  # replies and outputs for nobody are ignored silently
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_an_output_the_engine_cannot_read_ends_its_request_instead_of_hanging(engine, caplog):
    """A message that names a request but cannot be decoded (a field of the wrong type: what a
    stage of another version would send) fails that request at once; the engine serves on."""
    caplog.set_level(logging.WARNING, logger="omni_runtime")
    ipc_dir = engine.engine._orchestrator.backends["process"].ipc_dir
    stuck = asyncio.create_task(last(engine, "slow", {"delay_ms": 3000}, request_id="unreadable"))
    deadline = time.monotonic() + 5
    while "unreadable" not in engine.engine._channels.pending:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    wire_id = engine.engine._channels.pending["unreadable"].wire_id
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(f"ipc://{ipc_dir}/s0r0g0-out")
        assert sock.poll(5000, zmq.POLLOUT) == zmq.POLLOUT
        # In a wave's message, beside an output for nobody; its payload is a string, not a Payload.
        sock.send(_pack(["outputs", [["output", "nobody", True, "?"], ["output", wire_id, True, "not a payload"]]]))
        # (Unread, the echo would answer it normally after its 3 s.)
        with pytest.raises(StageExecutionError, match="could not read") as failed:
            await asyncio.wait_for(stuck, 5)
        assert failed.value.stage_id == 0
    finally:
        ctx.destroy(linger=0)
    assert (await last(engine, "after")).text == "after"
    assert any("dropped a malformed message" in r.getMessage() for r in caplog.records)
