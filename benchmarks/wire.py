"""Wire struct options: msgspec's ``array_like`` (fields as a msgpack array, not a map) and
``gc=False`` (instances the cycle collector does not track), measured on the runtime's hottest
messages, each variant beside the others in the same run.

(a) encode + decode time per message (a request, a wave of 8 outputs, an engine output) and the
    encoded size;
(b) the time a full ``gc.collect()`` takes with 100,000 decoded outputs alive (what a busy
    orchestrator holds between its requests).

    python -m benchmarks.wire [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import msgspec

from benchmarks._common import table, write_json

VARIANTS = {"map": {}, "array_like": {"array_like": True}, "array_like+gc=False": {"array_like": True, "gc": False}}


def make_types(options: dict[str, Any]) -> dict[str, Any]:
    """The wire messages of omni_runtime.messages (same fields), built with ``options``."""
    common = {"kw_only": True, "frozen": True, **options}
    payload = msgspec.defstruct(
        "Payload",
        [("text", str | None, None), ("images", list, []), ("tensors", dict, {}), ("metrics", dict, {})],
        **common,
    )
    request = msgspec.defstruct(
        "StageRequest",
        [("request_id", str), ("prompt", Any), ("params", dict), ("inputs", dict, {}), ("arrival_time", float, 0.0)],
        tag="request",
        **common,
    )
    output = msgspec.defstruct(
        "StageOutput",
        [("request_id", str), ("finished", bool, True), ("payload", payload, msgspec.field(default_factory=payload))],
        tag="output",
        **common,
    )
    outputs = msgspec.defstruct("StageOutputs", [("outputs", list[output])], tag="outputs", **common)
    engine_output = msgspec.defstruct(
        "EngineOutput",
        [
            ("request_id", str),
            ("stage_id", int),
            ("finished", bool),
            ("stage_finished", bool, True),
            ("payload", payload, msgspec.field(default_factory=payload)),
        ],
        tag="engine_output",
        **common,
    )
    return {"payload": payload, "request": request, "output": output, "outputs": outputs, "engine": engine_output}


def samples(t: dict[str, Any]) -> dict[str, Any]:
    metrics = {"queue_wait_ms": 1.25, "admission_wait_ms": 0.5, "batch_size": 8, "batch_id": 9, "execution_ms": 250.0}
    params = {"num_inference_steps": 4, "guidance_scale": 7.5, "height": 64, "width": 64, "seed": 42}
    return {
        "request": t["request"](request_id="abcdef012345-17#17", prompt="a cup of coffee", params=params),
        "wave of 8": t["outputs"](
            outputs=[
                t["output"](request_id=f"abcdef012345-{i}#{i}", payload=t["payload"](text=f"text {i}", metrics=metrics))
                for i in range(8)
            ]
        ),
        "engine output": t["engine"](
            request_id="abcdef012345-17#17", stage_id=0, finished=True, payload=t["payload"](text="ok", metrics=metrics)
        ),
    }


def codec_us(msg: Any, n: int = 20_000) -> float:
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(type(msg))
    start = time.perf_counter()
    for _ in range(n):
        dec.decode(enc.encode(msg))
    return (time.perf_counter() - start) / n * 1e6


def gc_ms(t: dict[str, Any], n: int = 100_000) -> float:
    msg = samples(t)["engine output"]
    data = msgspec.msgpack.encode(msg)
    dec = msgspec.msgpack.Decoder(type(msg))
    alive = [dec.decode(data) for _ in range(n)]
    gc.collect()
    start = time.perf_counter()
    gc.collect()
    elapsed = (time.perf_counter() - start) * 1000
    del alive
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    types = {name: make_types(options) for name, options in VARIANTS.items()}
    times: dict[tuple[str, str], list[float]] = {}
    collect: dict[str, list[float]] = {name: [] for name in VARIANTS}
    sizes: dict[tuple[str, str], int] = {}
    for _ in range(args.rounds):
        for name, t in types.items():  # interleaved: a noisy moment hits every variant alike
            for kind, msg in samples(t).items():
                times.setdefault((name, kind), []).append(codec_us(msg))
                sizes[(name, kind)] = len(msgspec.msgpack.encode(msg))
            collect[name].append(gc_ms(t))
    kinds = ("request", "wave of 8", "engine output")
    rows = []
    for name in VARIANTS:
        row: dict[str, Any] = {"variant": name}
        for kind in kinds:
            us = statistics.median(times[(name, kind)])
            base = statistics.median(times[("map", kind)])
            row[kind] = f"{us:.2f} µs ({base / us:.2f}x), {sizes[(name, kind)]} B"
        row["gc.collect, 100k alive"] = f"{statistics.median(collect[name]):.1f} ms"
        rows.append(row)
    print(table(rows, ["variant", *kinds, "gc.collect, 100k alive"]))
    if args.json:
        write_json(args.json, {"codec_us": {f"{k[0]}/{k[1]}": v for k, v in times.items()}, "gc_ms": collect})


if __name__ == "__main__":
    main()
