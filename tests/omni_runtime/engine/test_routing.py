"""The orchestrator's routing against a fake stage backend: no process, no socket, no AsyncOmni.

The fake replicas record what they are sent; the tests answer for them (outputs, errors,
deaths) and read what the orchestrator delivers on a caller's channel. Milliseconds each.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import janus

from omni_runtime.config import DeployConfig, StageConfig
from omni_runtime.engine.backends import EngineResources, StageBackend, StageClient
from omni_runtime.engine.orchestrator import Orchestrator
from omni_runtime.messages import (
    EngineAbort,
    EngineOutput,
    EngineRequest,
    EngineRpc,
    EngineRpcResult,
    EngineShutdown,
    ErrorInfo,
    Payload,
    StageAbort,
    StageMetrics,
    StageOutput,
    StagePing,
    StagePong,
    StageReady,
    StageRequest,
    StageRpc,
    StageRpcResult,
)
from omni_runtime.resolve import resolve_config
from tests.conftest import echo_stage, make_config

CHANNEL = 1


class FakeClient(StageClient):
    def __init__(self, backend: FakeBackend, stage: StageConfig, replica_id: int, on_message, on_dead) -> None:
        super().__init__(stage, replica_id, on_message, on_dead)
        self.backend = backend
        self.sent: list[Any] = []

    async def start(self) -> StageReady:
        self.alive = True
        self.ready = StageReady(stage_id=self.stage_id, replica_id=self.replica_id, pid=1000 + self.stage_id)
        return self.ready

    def send(self, msg: Any) -> None:
        if isinstance(msg, StagePing):  # a healthy replica answers heartbeats at once
            asyncio.get_running_loop().call_soon(self._on_message, self, StagePong(seq=msg.seq))
            return
        self.sent.append(msg)

    def kill(self, reason: str) -> None:
        self.alive = False
        self._on_dead(self, reason)

    async def close(self, timeout: float = 5.0) -> None:
        self.alive = False
        self.backend.closed.append((self.stage_id, self.replica_id))

    # what the test makes the replica say
    def say(self, msg: Any) -> None:
        self._on_message(self, msg)


class FakeBackend(StageBackend):
    name = "process"

    def __init__(self, config: DeployConfig, resources: EngineResources) -> None:
        super().__init__(config, resources)
        self.clients: dict[tuple[int, int], FakeClient] = {}
        self.closed: list[tuple[int, int]] = []
        self.settled: list[tuple[str, int | None]] = []

    def client(self, stage, replica_id, generation, on_message, on_dead) -> StageClient:
        c = FakeClient(self, stage, replica_id, on_message, on_dead)
        self.clients[(stage.stage_id, replica_id)] = c
        return c

    def settle(self, out: StageOutput, consumer: StageConfig | None) -> StageOutput:
        self.settled.append((out.request_id, None if consumer is None else consumer.stage_id))
        return out


class Harness:
    def __init__(self, config: DeployConfig) -> None:
        self.backend: FakeBackend | None = None
        self.deaths: list[Exception] = []

        def backends(cfg: DeployConfig, resources: EngineResources) -> dict[str, StageBackend]:
            self.backend = FakeBackend(cfg, resources)
            return {"process": self.backend}

        self.orch = Orchestrator(resolve_config(config), on_dead=self.deaths.append, make_backends=backends)
        self.out: janus.Queue = janus.Queue()
        self.orch.channels[CHANNEL] = self.out
        self.task: asyncio.Task | None = None
        self._ids = 0

    async def __aenter__(self) -> Harness:
        self.task = asyncio.ensure_future(self.orch._main())
        await asyncio.wrap_future(self.orch._ready)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.orch.request_queue.sync_q.put_nowait(EngineShutdown())
        await asyncio.wait_for(self.task, 5)
        self.orch.resources.release()

    def replica(self, stage_id: int, replica_id: int = 0) -> FakeClient:
        return self.backend.clients[(stage_id, replica_id)]

    def submit(self, prompt: str = "p", finals: list[int] | None = None, deadline_s: float | None = None, **params):
        self._ids += 1
        rid = f"r{self._ids}#1"
        stages = self.orch.config.stage_args
        msg = EngineRequest(
            request_id=rid,
            channel=CHANNEL,
            prompt=prompt,
            params={s.stage_id: dict(params) for s in stages},
            final_stage_ids=finals if finals is not None else self.orch.config.final_stage_ids,
            arrival_time=time.time(),
            deadline=None if deadline_s is None else time.monotonic() + deadline_s,
        )
        self.orch.request_queue.sync_q.put_nowait(msg)
        return rid

    async def sent(self, stage_id: int, kind: type = StageRequest, n: int = 1, replica_id: int = 0) -> list[Any]:
        """The first ``n`` messages of ``kind`` the replica got (waits a few loop turns for them)."""
        for _ in range(200):
            got = [m for m in self.replica(stage_id, replica_id).sent if isinstance(m, kind)]
            if len(got) >= n:
                return got
            await asyncio.sleep(0)
        raise AssertionError(f"stage {stage_id} got {got}, not {n} x {kind.__name__}")

    async def output(self) -> Any:
        return await asyncio.wait_for(self.out.async_q.get(), 2)

    def nothing_more(self) -> None:
        assert self.out.sync_q.empty()


def linear(**second: Any) -> DeployConfig:
    first = echo_stage(0, final_output=False)
    first.pop("final_output_type")
    return make_config([first, echo_stage(1, engine_input_source=[0], **second)])


async def test_a_request_flows_down_the_graph_and_is_delivered_once():
    async with Harness(linear()) as h:
        rid = h.submit("hello")
        [req0] = await h.sent(0)
        assert req0.request_id == rid and req0.prompt == "hello"
        assert not h.replica(1).sent  # stage 1 waits for stage 0
        h.replica(0).say(StageOutput(request_id=rid, payload=Payload(text="HELLO", metrics=StageMetrics(batch_size=1))))
        # The caller hears that the inner stage is done, with its timings and without its data.
        notice = await h.output()
        assert notice.stage_id == 0 and not notice.finished and not notice.stage_finished
        assert notice.payload.text is None and notice.payload.stage_done
        assert notice.payload.metrics == StageMetrics(batch_size=1)
        [req1] = await h.sent(1)
        assert req1.prompt == "HELLO" and req1.inputs == {"text": "HELLO"}
        assert h.backend.settled == [(rid, 1)]  # one consumer, no input function: handed over as it is
        h.replica(1).say(StageOutput(request_id=rid, payload=Payload(text="done")))
        out = await h.output()
        assert isinstance(out, EngineOutput) and out.finished and out.stage_id == 1 and out.payload.text == "done"
        assert out.payload.metrics.e2e_ms >= 0
        assert h.backend.settled[-1] == (rid, None)  # delivered to the caller: plain values
        await asyncio.sleep(0)
        h.nothing_more()
        assert all(s.inflight == 0 for s in h.orch.status().values())


async def test_fan_out_then_fan_in_waits_for_every_source_and_calls_the_input_function():
    stages = [
        echo_stage(0, final_output=False),
        echo_stage(1, engine_input_source=[0], final_output=False),
        echo_stage(2, engine_input_source=[0], final_output_type="tensor"),
        echo_stage(3, engine_input_source=[1, 2], custom_process_input_func="tests.helpers:shout"),
    ]
    for s in stages[:2]:
        s.pop("final_output_type")
    async with Harness(make_config(stages)) as h:
        rid = h.submit("x")
        await h.sent(0)
        h.replica(0).say(StageOutput(request_id=rid, payload=Payload(text="a")))
        await h.sent(1)
        await h.sent(2)
        assert (await h.output()).payload.stage_done  # stage 0's notice
        assert (rid, None) in h.backend.settled  # two consumers: each gets its own values
        h.replica(2).say(StageOutput(request_id=rid, payload=Payload(text="c")))
        first = await h.output()
        assert first.stage_id == 2 and not first.finished
        await asyncio.sleep(0)
        assert not h.replica(3).sent  # still waits for stage 1
        h.replica(1).say(StageOutput(request_id=rid, payload=Payload(text="b")))
        [req3] = await h.sent(3)
        assert (await h.output()).stage_id == 1  # stage 1's notice
        assert req3.prompt == "1:B | 2:C" and req3.inputs == {"original": "x"}
        h.replica(3).say(StageOutput(request_id=rid, payload=Payload(text="end")))
        last = await h.output()
        assert last.finished and last.stage_id == 3


async def test_only_the_stages_a_requested_output_needs_run():
    # Stage 0 is final too, and only its output is asked for: stage 1 never runs.
    first = echo_stage(0)
    config = make_config([first, echo_stage(1, engine_input_source=[0])])
    async with Harness(config) as h:
        rid = h.submit("only zero", finals=[0])
        await h.sent(0)
        h.replica(0).say(StageOutput(request_id=rid, payload=Payload(text="zero")))
        out = await h.output()
        assert out.finished and out.stage_id == 0
        await asyncio.sleep(0)
        assert not h.replica(1).sent


async def test_an_abort_reaches_the_replica_and_a_late_output_is_dropped():
    async with Harness(linear()) as h:
        rid = h.submit()
        await h.sent(0)
        reason = ErrorInfo(type="RequestAbortedError", message="by the caller")
        h.orch.request_queue.sync_q.put_nowait(EngineAbort(request_ids=[rid], reason=reason))
        [abort] = await h.sent(0, StageAbort)
        assert abort.request_ids == [rid]
        out = await h.output()
        assert out.finished and out.error.type == "RequestAbortedError"
        h.replica(0).say(StageOutput(request_id=rid, payload=Payload(text="too late")))
        await asyncio.sleep(0.01)
        h.nothing_more()
        assert not h.replica(1).sent


async def test_a_deadline_ends_the_request_and_aborts_it_in_the_stage():
    async with Harness(linear()) as h:
        rid = h.submit(deadline_s=0.05)
        await h.sent(0)
        out = await h.output()
        assert out.error.type == "RequestTimeoutError" and out.finished
        [abort] = await h.sent(0, StageAbort)
        assert abort.request_ids == [rid]


async def test_a_stage_error_ends_the_request_with_its_type_and_stage():
    async with Harness(linear()) as h:
        rid = h.submit()
        await h.sent(0)
        err = ErrorInfo(type="StageExecutionError", message="NaN", stage_id=0)
        h.replica(0).say(StageOutput(request_id=rid, error=err))
        out = await h.output()
        assert out.error.type == "StageExecutionError" and out.error.stage_id == 0 and out.stage_id == 0
        await asyncio.sleep(0)
        assert not h.replica(1).sent


async def test_streamed_pieces_reach_the_caller_before_the_end():
    async with Harness(make_config([echo_stage(0)])) as h:
        rid = h.submit()
        await h.sent(0)
        h.replica(0).say(StageOutput(request_id=rid, finished=False, payload=Payload(text="par")))
        h.replica(0).say(StageOutput(request_id=rid, finished=False, payload=Payload(text="tial")))
        h.replica(0).say(StageOutput(request_id=rid, payload=Payload(text="partial")))
        outs = [await h.output() for _ in range(3)]
        assert [(o.payload.text, o.finished, o.stage_finished) for o in outs] == [
            ("par", False, False),
            ("tial", False, False),
            ("partial", True, True),
        ]


async def test_a_replica_death_fails_what_it_held_and_the_last_one_kills_the_engine():
    config = make_config([echo_stage(0, runtime={"num_replicas": 2, "max_restarts": 0})])
    async with Harness(config) as h:
        a, b = h.submit("a"), h.submit("b")
        await asyncio.sleep(0.01)
        held = {r: [m.request_id for m in h.replica(0, r).sent if isinstance(m, StageRequest)] for r in (0, 1)}
        assert sorted(held[0] + held[1]) == sorted([a, b]) and held[0] and held[1]  # least loaded: one each
        h.replica(0, 0).kill("replica 0 crashed")
        out = await h.output()
        assert out.request_id == held[0][0] and out.error.type == "StageDeadError"
        assert not h.deaths  # the other replica still serves
        h.replica(0, 1).kill("replica 1 crashed")
        out = await h.output()
        assert out.request_id == held[1][0] and out.error.type == "StageDeadError"
        assert len(h.deaths) == 1 and "no restart left" in str(h.deaths[0])
        refused = h.submit("after")
        out = await h.output()
        assert out.request_id == refused and out.error.type == "EngineDeadError"


async def test_control_calls_fan_out_and_a_silent_replica_times_out():
    config = make_config([echo_stage(0, runtime={"num_replicas": 2})])
    async with Harness(config) as h:
        h.orch.request_queue.sync_q.put_nowait(
            EngineRpc(call_id=7, channel=CHANNEL, method="ping", args=[1], kwargs={"k": 2}, timeout=0.2)
        )
        [rpc] = await h.sent(0, StageRpc, replica_id=0)
        await h.sent(0, StageRpc, replica_id=1)
        assert (rpc.method, rpc.args, rpc.kwargs) == ("ping", [1], {"k": 2})
        h.replica(0, 0).say(StageRpcResult(call_id=rpc.call_id, result={"pong": 0}))
        out = await h.output()
        assert isinstance(out, EngineRpcResult) and out.call_id == 7
        assert [(r.replica_id, r.result, r.error) for r in out.results] == [
            (0, {"pong": 0}, None),
            (1, None, "timed out after 0.2 s"),
        ]


async def test_closing_closes_every_replica_and_fails_what_is_pending():
    h = Harness(linear())
    async with h:
        rid = h.submit()
        await h.sent(0)
    out = await h.output()
    assert out.request_id == rid and out.error.type == "EngineClosedError"
    assert sorted(h.backend.closed) == [(0, 0), (1, 0)]
