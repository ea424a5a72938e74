"""What the runtime adds around a model: echo stage in its own process vs a bare pyzmq round trip.

(a) sequential round-trip latency through AsyncOmni and Omni, beside a bare pyzmq PUSH/PULL round
    trip to another process (msgspec-encoded message), measured in the same run;
(b) throughput with N requests in flight through AsyncOmni.

    python -m benchmarks.overhead [--sequential 2000] [--inflight 1000] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import msgspec
import uvloop
import zmq

from benchmarks._common import summary, table, write_json
from omni_runtime import AsyncOmni, Omni
from omni_runtime.config import load_config

_ECHO_SERVER = """
import sys, zmq, msgspec
ctx = zmq.Context(); pull = ctx.socket(zmq.PULL); push = ctx.socket(zmq.PUSH)
pull.connect(sys.argv[1]); push.connect(sys.argv[2])
dec = msgspec.msgpack.Decoder(dict); enc = msgspec.msgpack.Encoder()
while True:
    msg = dec.decode(pull.recv())
    if msg.get("stop"):
        break
    push.send(enc.encode(msg))
"""


def bare_zmq_rtt(n: int) -> list[float]:
    """Round trips to a child process over ipc PUSH/PULL, the transport the runtime uses."""
    import tempfile

    d = tempfile.mkdtemp(prefix="omni-bench-")
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(f"ipc://{d}/in")
    pull.bind(f"ipc://{d}/out")
    child = subprocess.Popen([sys.executable, "-c", _ECHO_SERVER, f"ipc://{d}/in", f"ipc://{d}/out"])
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(dict)
    msg = {"request_id": "x" * 32, "prompt": "hello", "params": {}}
    lat = []
    try:
        for i in range(n + 100):
            t = time.perf_counter()
            push.send(enc.encode(msg))
            dec.decode(pull.recv())
            if i >= 100:  # warm-up
                lat.append((time.perf_counter() - t) * 1000)
        push.send(enc.encode({"stop": True}))
        child.wait(5)
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()
        __import__("shutil").rmtree(d, ignore_errors=True)
    return lat


async def async_sequential(engine: AsyncOmni, n: int) -> list[float]:
    lat = []
    for i in range(n + 100):
        t = time.perf_counter()
        async for _ in engine.generate("hello"):
            pass
        if i >= 100:
            lat.append((time.perf_counter() - t) * 1000)
    return lat


async def async_inflight(engine: AsyncOmni, n: int) -> tuple[float, list[float]]:
    async def one() -> float:
        t = time.perf_counter()
        async for _ in engine.generate("hello"):
            pass
        return (time.perf_counter() - t) * 1000

    t0 = time.perf_counter()
    lat = await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - t0), list(lat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequential", type=int, default=2000)
    ap.add_argument("--inflight", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    config = load_config("echo")
    rows, report = [], {"rounds": []}
    with AsyncOmni(config, max_pending=max(2048, 2 * args.inflight)) as engine:
        loop = uvloop.new_event_loop()
        loop.run_until_complete(async_inflight(engine, 200))  # warm-up
        for r in range(args.rounds):
            # Interleave the measurements so machine noise hits them alike.
            bare = summary(bare_zmq_rtt(args.sequential))
            full = summary(loop.run_until_complete(async_sequential(engine, args.sequential)))
            rate, lat = loop.run_until_complete(async_inflight(engine, args.inflight))
            inflight = summary(lat)
            rows.append(
                {
                    "round": r,
                    "bare_zmq_p50_ms": bare["p50_ms"],
                    "bare_zmq_p99_ms": bare["p99_ms"],
                    "asyncomni_p50_ms": full["p50_ms"],
                    "asyncomni_p99_ms": full["p99_ms"],
                    "p50_ratio": full["p50_ms"] / bare["p50_ms"],
                    f"inflight{args.inflight}_req_s": rate,
                    "inflight_p50_ms": inflight["p50_ms"],
                }
            )
            report["rounds"].append({"bare": bare, "asyncomni": full, "inflight_req_s": rate, "inflight": inflight})
    with Omni(config) as omni:
        omni.generate(["warm"] * 50, use_tqdm=False)
        t = time.perf_counter()
        for _ in range(500):
            omni.generate("hello", use_tqdm=False)
        omni_p_mean = (time.perf_counter() - t) / 500 * 1000
    print(table(rows, list(rows[0])))
    print(f"\nOmni.generate (blocking API), one prompt per call: mean {omni_p_mean:.3f} ms")
    best = min(rows, key=lambda r: r["p50_ratio"])
    print(
        f"median-of-rounds p50 ratio (full path / bare zmq): "
        f"{sorted(r['p50_ratio'] for r in rows)[len(rows) // 2]:.2f}  (best {best['p50_ratio']:.2f}; target <= 2)"
    )
    rates = sorted(r[f"inflight{args.inflight}_req_s"] for r in rows)
    print(f"in-flight throughput median {rates[len(rates) // 2]:.0f} req/s (target >= 10000)")
    report["omni_blocking_mean_ms"] = omni_p_mean
    write_json(args.json, report)


if __name__ == "__main__":
    main()
