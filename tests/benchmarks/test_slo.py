"""The SLO benchmark's parts (benchmarks/slo.py): the trace format and its errors, the generator's
determinism and shape, the figures it reports from a replay's records, and one replay against a
real server, where a request whose SLO cannot be met is counted as shed."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from typing import Any

import msgspec
import pytest
from omni_runtime.entrypoints.openai.protocol import GenerateRequest

from benchmarks.slo import (
    CLASSES,
    SERVERS,
    Record,
    TraceError,
    TraceRequest,
    body_of,
    check_servers,
    client_for,
    deploy_config,
    dump_trace,
    generate,
    outcome,
    parse_trace,
    ratios,
    replay,
    report,
    score,
    sequential_rps,
    with_slos,
)

LINE = {
    "t": 0.5, "task": "text2video", "model": "tiny-wan", "width": 32, "height": 32, "num_frames": 9,
    "steps": 4, "seed": 7, "slo_ms": None, "class": "vid-9",
}  # fmt: skip


def lines(*objects: dict[str, Any] | str) -> str:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objects)


# ---------------------------------------------------------------- the trace format


@pytest.mark.unit
def test_a_trace_round_trips_and_null_slo_and_frames_are_allowed() -> None:
    image = {**LINE, "t": 1, "task": "text2image", "num_frames": None, "class": "img-32", "slo_ms": 250}
    trace = parse_trace(lines(LINE, "", image), "t.jsonl")
    assert [r.cls for r in trace] == ["vid-9", "img-32"]
    assert trace[0].slo_ms is None and trace[1].slo_ms == 250.0 and trace[1].t == 1.0
    assert parse_trace(dump_trace(trace)) == trace
    assert json.loads(dump_trace(trace).splitlines()[0]) == LINE  # `class`, not the attribute's name


@pytest.mark.unit
@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "not a JSON object"),
        ("[1, 2]", "Expected `object`"),
        ({**LINE, "colour": "red"}, "unknown field `colour`"),
        ({k: v for k, v in LINE.items() if k != "class"}, "missing required field `class`"),
        ({**LINE, "width": 100_000}, "`$.width`"),
        ({**LINE, "steps": 0}, "`$.steps`"),
        ({**LINE, "seed": 1.5}, "`$.seed`"),
        ({**LINE, "steps": True}, "`$.steps`"),
        ({**LINE, "t": -1}, "`$.t`"),
        ({**LINE, "slo_ms": 0}, "`$.slo_ms`"),
        ({**LINE, "task": "text2speech"}, "`$.task`"),
        ({**LINE, "class": ""}, "`$.class`"),
        ({**LINE, "task": "text2image"}, "num_frames is for task text2video"),
    ],
)
def test_a_bad_line_is_refused_naming_the_file_line_and_field(line: dict[str, Any] | str, says: str) -> None:
    with pytest.raises(TraceError) as e:
        parse_trace(lines(LINE, line), "trace.jsonl")
    assert str(e.value).startswith("trace.jsonl:2: ") and says in str(e.value), str(e.value)


@pytest.mark.unit
def test_a_trace_out_of_order_or_empty_is_refused() -> None:
    with pytest.raises(TraceError, match=r"x:2: t 0.1 is before the line above it \(0.5\)"):
        parse_trace(lines(LINE, {**LINE, "t": 0.1}), "x")
    with pytest.raises(TraceError, match="x: no requests"):
        parse_trace("\n\n", "x")


# ---------------------------------------------------------------- the generator


@pytest.mark.unit
def test_the_generator_is_seeded() -> None:
    a, b = generate(3, 30, 4.0), generate(3, 30, 4.0)
    assert a == b and a != generate(4, 30, 4.0)
    assert all(r.slo_ms is None and r.model == "tiny-wan" for r in a)


@pytest.mark.unit
def test_a_generated_trace_mixes_the_classes_at_the_mean_rate_in_bursts() -> None:
    duration, rate = 2000.0, 5.0
    trace = generate(11, duration, rate)
    times = [r.t for r in trace]
    assert times == sorted(times) and times[0] >= 0 and times[-1] < duration
    assert len(trace) == pytest.approx(duration * rate, rel=0.1)
    assert len({r.seed for r in trace}) == len(trace)  # no two requests alike
    counts = Counter(r.cls for r in trace)
    for c in CLASSES:
        assert counts[c.name] / len(trace) == pytest.approx(c.weight, abs=0.03)
        [one] = {(r.task, r.width, r.height, r.num_frames, r.steps) for r in trace if r.cls == c.name}
        assert one == (c.task, c.width, c.height, c.num_frames, c.steps)
    # Bursts and quiet periods: counts per second scatter far more than a Poisson process's
    # (whose variance equals its mean).
    per_second = Counter(int(t) for t in times)
    counts_s = [per_second.get(s, 0) for s in range(int(duration))]
    assert statistics.variance(counts_s) / statistics.fmean(counts_s) > 2.0
    assert max(counts_s) >= 3 * rate


@pytest.mark.unit
def test_slos_are_filled_from_solo_times_and_a_given_one_is_kept() -> None:
    trace = parse_trace(lines(LINE, {**LINE, "t": 1, "slo_ms": 99.0}, {**LINE, "t": 2, "class": "img-32"}))
    filled = with_slos(trace, {"vid-9": 200.0, "img-32": 50.0}, 3.0)
    assert [r.slo_ms for r in filled] == [600.0, 99.0, 150.0]
    with pytest.raises(ValueError, match=r"no solo time for classes \['img-32'\]"):
        with_slos(trace, {"vid-9": 200.0}, 3.0)


@pytest.mark.unit
def test_sequential_throughput_is_the_mix_one_request_after_another() -> None:
    # One request of each: 100 + 300 ms for two requests.
    assert sequential_rps({"a": 1, "b": 1}, {"a": 100.0, "b": 300.0}) == pytest.approx(5.0)
    assert sequential_rps({"a": 3, "b": 1}, {"a": 100.0, "b": 300.0}) == pytest.approx(4 / 0.6)


# ---------------------------------------------------------------- requests and figures


@pytest.mark.unit
def test_a_request_body_is_what_post_v1_generate_takes() -> None:
    video = msgspec.convert({**LINE, "slo_ms": 600.0}, TraceRequest)
    image = msgspec.convert({**LINE, "task": "text2image", "num_frames": None}, TraceRequest)
    body = body_of(video)
    assert body["async_run"] is False and body["config"] == {"slo_ms": 600.0}
    assert body["inputs"]["num_frames"] == 9 and body["inputs"]["num_inference_steps"] == 4
    assert "num_frames" not in body_of(image)["inputs"] and body_of(image)["config"] == {}
    for b in (body, body_of(image)):
        GenerateRequest.model_validate(b)  # strict: an unknown or misspelt field fails here


@pytest.mark.unit
@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (200, {"status": "completed", "result": {}}, "ok"),
        (429, {"error": {"code": "queue_full"}}, "shed"),
        (200, {"status": "failed", "error": {"status": 429, "code": "queue_full", "message": "slo"}}, "shed"),
        (200, {"status": "failed", "error": {"status": 500, "code": "stage_error", "message": "boom"}}, "error"),
        (400, {"error": {"message": "bad size"}}, "error"),
        (502, "<html>", "error"),
    ],
)
def test_an_answer_is_ok_shed_or_an_error(status: int, body: Any, expected: str) -> None:
    got, error = outcome(status, body)
    assert got == expected and (error is None) == (expected != "error")


def rec(i: int, cls: str, latency: float, status: str = "ok", slo: float | None = 100.0, batch: int = 1) -> Record:
    return Record(
        index=i, cls=cls, slo_ms=slo, arrival_s=i * 0.1, sent_s=i * 0.1 + 0.002, finished_s=i * 0.1 + latency / 1000,
        latency_ms=latency, status=status, batch_size=batch,
    )  # fmt: skip


@pytest.mark.unit
def test_attainment_goodput_and_percentiles_from_records() -> None:
    records = [
        rec(0, "a", 50.0),  # met
        rec(1, "a", 150.0, batch=3),  # late
        rec(2, "a", 80.0),  # met
        rec(3, "b", 20.0, status="shed"),  # a miss, not a latency
        rec(4, "b", 90.0, slo=None),  # no SLO: answered is met
        rec(5, "b", 5.0, status="error"),
    ]
    s = score(records, wall_s=2.0)
    assert (s["requests"], s["met"], s["ok"], s["shed"], s["errors"]) == (6, 3, 4, 1, 1)
    assert s["attainment"] == pytest.approx(3 / 6)
    assert s["goodput_rps"] == pytest.approx(3 / 2.0) and s["throughput_rps"] == pytest.approx(4 / 2.0)
    assert s["mean_batch"] == pytest.approx((1 + 3 + 1 + 1) / 4)
    assert s["max_send_lag_ms"] == pytest.approx(2.0)
    a, b = s["classes"]["a"], s["classes"]["b"]
    assert (a["requests"], a["met"], a["p50_ms"], a["p99_ms"]) == (3, 2, 80.0, 150.0)
    assert (b["requests"], b["met"], b["shed"], b["p50_ms"], b["p99_ms"]) == (3, 1, 1, 90.0, 90.0)
    assert b["attainment"] == pytest.approx(1 / 3)


@pytest.mark.unit
def test_the_report_compares_each_server_to_the_baseline_round_by_round() -> None:
    def result(attainment: float, goodput: float) -> dict[str, Any]:
        r = score([rec(0, "a", 50.0)], 1.0)
        return r | {"attainment": attainment, "goodput_rps": goodput, "solo_ms": {"a": 40.0}, "sequential_rps": 2.0}

    results = [
        {"round": rnd, "server": srv, "load1": 0.5, "result": result(att, good) | {"offered_rps": 3.0}}
        for rnd, srv, att, good in [
            (0, "fcfs", 0.4, 1.0), (0, "deadline", 0.8, 1.1), (1, "fcfs", 0.5, 1.0), (1, "deadline", 0.6, 1.3),
        ]
    ]  # fmt: skip
    rows = {r["server"]: r for r in ratios(results, "fcfs")}
    assert rows["fcfs"]["attainment/fcfs"] == 1.0
    assert rows["deadline"]["attainment/fcfs"] == pytest.approx(statistics.median([2.0, 1.2]))
    assert rows["deadline"]["goodput/fcfs"] == pytest.approx(1.2)
    text = report(results, "fcfs")
    assert "| round | server | seq_rps |" in text and "| attainment/fcfs |" in text and "| deadline |" in text


@pytest.mark.unit
def test_each_server_is_the_tiny_wan_stage_with_its_own_engine_args() -> None:
    for name, engine_args in SERVERS.items():
        config = deploy_config(name, threads=1)
        [stage] = config["stage_args"]
        assert stage["engine_args"] == engine_args and stage["runtime"]["torch_threads"] == 1
        assert stage["model"] == "builtin:tiny-wan" and config["model"] == "tiny-wan"
    check_servers(["fcfs", "window", "learned"], threads=0)
    with pytest.raises(SystemExit, match="unknown server 'fifo'"):
        check_servers(["fcfs", "fifo"], threads=0)


# ---------------------------------------------------------------- a replay against a real server


@pytest.mark.integration
async def test_a_trace_replays_against_a_server_and_an_impossible_slo_is_shed(tmp_path) -> None:
    from tests.entrypoints.openai.server_process import start_server, stop_server, write_config

    # The deadline policy with shedding (step execution, over HTTP, through the job layer): the
    # first requests teach the stage what a step of the 32 x 32 x 9 key costs; then a request of
    # that key whose target its steps alone exceed is shed, and one of an unmeasured key (48 x 48)
    # is not, however tight its target would be.
    config = deploy_config("deadline+shed", threads=1)
    server = start_server(str(write_config(tmp_path / "slo.yaml", config)), log=tmp_path / "server.log")
    try:
        trace = parse_trace(
            lines(
                {**LINE, "t": 0.0, "slo_ms": 120_000},
                {**LINE, "t": 0.05, "num_frames": 5, "class": "vid-5", "slo_ms": 120_000},
                {**LINE, "t": 1.5, "class": "vid-9", "slo_ms": 1},  # cannot be met: shed at once
                {**LINE, "t": 1.55, "num_frames": 1, "width": 48, "height": 48, "class": "img-48", "slo_ms": 1},
            )
        )
        async with client_for(server.url) as client:
            records, wall = await replay(client, trace)
    finally:
        stop_server(server)
    assert [r.status for r in records] == ["ok", "ok", "shed", "ok"], [r.error for r in records]
    # The stage refused it after the engine admitted the job: the synchronous form answers the
    # failed job with its 429 (it was a 200 before).
    assert records[2].http_status == 429
    s = score(records, wall)
    assert (s["met"], s["shed"], s["errors"]) == (2, 1, 0)  # the unmeasured key's is served, late
    assert s["attainment"] == pytest.approx(0.5)
    assert all(r.sent_s - r.arrival_s < 0.5 for r in records)  # open loop: sent on time
