"""Tensor transfer between two stage processes through the runtime, beside pickle over pyzmq.

Runtime: a producer stage returns a float32 tensor of the requested size, the orchestrator routes
it to a consumer stage (each stage in its own process), and the consumer answers with a small
checksum. Over ``ipc`` the tensor goes through shared memory (the handle passes the orchestrator
without a copy); over ``tcp`` as raw msgpack frames. Baseline: one plain process sends the same
array to another with ``pickle.dumps(protocol=5)`` over a pyzmq ipc PUSH socket and waits for a
small ack. Each path moves one tensor at a time.

The receiving stage gets the tensor mapped in the producer's slot (no copy on its side); the
pickle receiver gets its own copy. ``--touch`` makes both receivers read every byte (a sum), for
the end-to-end cost when the receiver uses all of the data.

    python -m benchmarks.transfer [--sizes-mib 4 64] [--seconds 3] [--rounds 3] [--touch] [--no-tcp] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, ClassVar

import msgspec
import numpy as np
import zmq

from benchmarks._common import table, write_json
from omni_runtime.params import EchoSamplingParams
from omni_runtime.stage.runners.base import ExecuteContext, RunnerOutput, RunnerRequest, StageRunner

MIB = 1 << 20


# --------------------------------------------------------------------------- runtime path
# The stage processes import these runners as ``benchmarks.transfer:...`` (they see this
# process's import path; run from the repository root).


class TransferParams(EchoSamplingParams):
    nbytes: int | None = None
    #: The consumer reads every byte (a sum) instead of one element.
    touch: bool | None = None


class ProducerRunner(StageRunner):
    """Returns one cached tensor per size: the benchmark measures moving it, not making it."""

    params_cls: ClassVar[type[msgspec.Struct]] = TransferParams
    _cache: ClassVar[dict[int, np.ndarray]] = {}

    def runs_inline(self, batch: list[RunnerRequest]) -> bool:
        return True

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        outputs = []
        for req in batch:
            n = int(req.params.nbytes) // 4
            if n not in self._cache:
                self._cache[n] = np.arange(n, dtype=np.float32)
            outputs.append(RunnerOutput(tensors={"payload": self._cache[n]}))
        return outputs


class ConsumerRunner(StageRunner):
    """Answers with the tensor's size and a checksum of a few elements."""

    params_cls: ClassVar[type[msgspec.Struct]] = TransferParams

    def runs_inline(self, batch: list[RunnerRequest]) -> bool:
        return True

    def execute(self, batch: list[RunnerRequest], ctx: ExecuteContext) -> list[RunnerOutput]:
        outputs = []
        for req in batch:
            arr = req.inputs["payload"]
            if req.params.touch:
                arr.sum()
            outputs.append(RunnerOutput(text=f"{arr.nbytes}:{float(arr[-1])}"))
        return outputs


def runtime_config(transport: str) -> Any:
    from omni_runtime.config import parse_config

    runtime = {"backend": "process", "torch_threads": 1, "transport": transport}
    return parse_config(
        {
            "model": f"transfer-{transport}",
            "stage_args": [
                {"stage_id": 0, "stage_type": "benchmarks.transfer:ProducerRunner", "runtime": runtime},
                {
                    "stage_id": 1,
                    "stage_type": "benchmarks.transfer:ConsumerRunner",
                    "runtime": runtime,
                    "engine_input_source": [0],
                    "final_output": True,
                    "final_output_type": "text",
                },
            ],
        },
        source="transfer",
    )


async def runtime_rate(engine: Any, nbytes: int, seconds: float, touch: bool) -> tuple[float, int]:
    """MiB/s moving one tensor at a time for about ``seconds``; (rate, transfers)."""
    params = [{"nbytes": nbytes}, {"nbytes": nbytes, "touch": touch}]
    expected = f"{nbytes}:{float(nbytes // 4 - 1)}"

    async def one() -> None:
        out = None
        async for out in engine.generate("x", params):
            pass
        assert out is not None and out.text == expected, out

    for _ in range(3):  # warm-up: segments created, pages mapped
        await one()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or n < 5:
        await one()
        n += 1
    return nbytes * n / MIB / elapsed, n


# --------------------------------------------------------------------------- pickle baseline

_PICKLE_RECEIVER = """
import pickle, sys, zmq
ctx = zmq.Context(); pull = ctx.socket(zmq.PULL); push = ctx.socket(zmq.PUSH)
pull.connect(sys.argv[1]); push.connect(sys.argv[2])
while True:
    arr = pickle.loads(pull.recv(copy=False).buffer)
    if arr is None:
        break
    if sys.argv[3] == "touch":
        arr.sum()
    push.send(b"%d:%r" % (arr.nbytes, float(arr[-1])))
"""


class PickleLink:
    """A plain child process that unpickles what it is sent and acks with a checksum."""

    def __init__(self, touch: bool) -> None:
        self._dir = tempfile.mkdtemp(prefix="omni-bench-")
        self._ctx = zmq.Context()
        self._push, self._pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._push.bind(f"ipc://{self._dir}/in")
        self._pull.bind(f"ipc://{self._dir}/out")
        self._child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                _PICKLE_RECEIVER,
                f"ipc://{self._dir}/in",
                f"ipc://{self._dir}/out",
                "touch" if touch else "-",
            ]
        )

    def rate(self, nbytes: int, seconds: float) -> tuple[float, int]:
        arr = np.arange(nbytes // 4, dtype=np.float32)
        expected = f"{nbytes}:{float(arr[-1])!r}".encode()

        def one() -> None:
            self._push.send(pickle.dumps(arr, protocol=5), copy=False)
            assert self._pull.recv() == expected

        for _ in range(3):
            one()
        n, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds or n < 5:
            one()
            n += 1
        return nbytes * n / MIB / elapsed, n

    def close(self) -> None:
        self._push.send(pickle.dumps(None, protocol=5))
        self._child.wait(10)
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


# --------------------------------------------------------------------------- report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64])
    ap.add_argument("--seconds", type=float, default=3.0, help="per size, path and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--touch", action="store_true", help="receivers read every byte of each tensor")
    ap.add_argument("--no-tcp", action="store_true", help="skip the runtime-over-tcp (raw frames) row")
    ap.add_argument("--json")
    args = ap.parse_args()

    from omni_runtime import AsyncOmni

    transports = ["ipc"] if args.no_tcp else ["ipc", "tcp"]
    engines = {t: AsyncOmni(runtime_config(t)) for t in transports}
    link = PickleLink(args.touch)
    loop = asyncio.new_event_loop()
    results: dict[tuple[str, int], list[float]] = {}
    try:
        for _ in range(args.rounds):
            # Interleave the paths so machine noise hits them alike.
            for mib in args.sizes_mib:
                nbytes = mib * MIB
                results.setdefault(("pickle", mib), []).append(link.rate(nbytes, args.seconds)[0])
                for t, engine in engines.items():
                    rate = loop.run_until_complete(runtime_rate(engine, nbytes, args.seconds, args.touch))[0]
                    results.setdefault((t, mib), []).append(rate)
    finally:
        link.close()
        for engine in engines.values():
            engine.close()
        loop.run_until_complete(asyncio.sleep(0))  # let the engines' dispatcher tasks see their cancellation
        loop.close()

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    rows = []
    for mib in args.sizes_mib:
        base = median(results[("pickle", mib)])
        row: dict[str, Any] = {"size_mib": mib, "pickle_pyzmq_MBps": base * MIB / 1e6}
        for t in transports:
            rate = median(results[(t, mib)])
            label = "runtime_shm" if t == "ipc" else "runtime_tcp_frames"
            row[f"{label}_MBps"] = rate * MIB / 1e6
            row[f"{label}_x_pickle"] = rate / base
        rows.append(row)
    print(table(rows, list(rows[0])))
    touched = ", receivers read every byte" if args.touch else ""
    print(f"\nmedian of {args.rounds} rounds of {args.seconds:g} s{touched}; MB = 10^6 bytes")
    print("target at 64 MiB: runtime_shm >= 4x pickle")
    write_json(
        args.json,
        {"rows": rows, "raw_MiBps": {f"{k[0]}_{k[1]}MiB": v for k, v in results.items()}},
    )


if __name__ == "__main__":
    main()
