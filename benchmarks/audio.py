"""Speech serving with ``tiny-tts``: requests per second sequential vs batched, and time to first
audio byte over HTTP, streamed vs not, in one run.

1) Engine (``Omni("tiny-tts")``, one stage process): ``--requests`` texts of mixed lengths, first one
   request at a time (each waits for the last), then all submitted at once, so that the stage fuses
   them into waves of up to ``max_num_seqs`` (one batched VITS forward each).
2) HTTP (``omni-runtime serve tiny-tts``): ``--rounds`` requests of one text each way, one at a time:
   ``stream_format: audio`` with ``pcm`` (chunks sent as they are encoded) and a whole ``mp3``;
   time from sending the request to the first body byte, and to the last.

    python -m benchmarks.audio [--requests 32] [--rounds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx

from benchmarks._common import Server, summary, table, write_json

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "tired",
    "owls",
    "watch",
    "from",
    "the",
    "old",
    "oak",
]


def texts(n: int) -> list[str]:
    """``n`` texts of 3 to 15 words, the same each run."""
    return [" ".join(WORDS[(i * 5) % len(WORDS) :][: 3 + (i * 7) % 13] or WORDS[:3]) for i in range(n)]


def engine(n: int) -> list[dict[str, Any]]:
    from omni_runtime import Omni

    prompts = texts(n)
    rows = []
    with Omni("tiny-tts") as omni:
        omni.generate(prompts[:2], {"seed": 0}, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        for p in prompts:
            omni.generate(p, {"seed": 1}, use_tqdm=False)
        seq = time.perf_counter() - start
        start = time.perf_counter()
        outs = omni.generate(prompts, {"seed": 1}, use_tqdm=False)
        bat = time.perf_counter() - start
        mean_batch = sum(o.metrics["batch_size"] for o in outs) / len(outs)
    rows.append(
        {"mode": "sequential", "requests": n, "seconds": round(seq, 3), "req_per_s": round(n / seq, 2), "mean_batch": 1}
    )
    rows.append(
        {
            "mode": "batched",
            "requests": n,
            "seconds": round(bat, 3),
            "req_per_s": round(n / bat, 2),
            "mean_batch": round(mean_batch, 2),
        }
    )
    return rows


def http(rounds: int) -> list[dict[str, Any]]:
    text = " ".join(WORDS)
    rows = []
    with Server("tiny-tts") as srv, httpx.Client(base_url=srv.url, timeout=120) as client:
        for fmt in ("pcm", "mp3"):  # warm-up
            client.post("/v1/audio/speech", json={"input": text, "voice": "alloy", "response_format": fmt})
        modes = (("pcm", "streamed pcm"), ("mp3", "whole mp3"))
        first: dict[str, list[float]] = {fmt: [] for fmt, _ in modes}
        last: dict[str, list[float]] = {fmt: [] for fmt, _ in modes}
        for _ in range(rounds):  # the modes interleaved, so that a busy spell hits both alike
            for fmt, _label in modes:
                body = {"input": text, "voice": "alloy", "response_format": fmt, "seed": 1}
                start = time.perf_counter()
                got_first = None
                with client.stream("POST", "/v1/audio/speech", json=body) as resp:
                    for chunk in resp.iter_raw():
                        if chunk and got_first is None:
                            got_first = time.perf_counter()
                end = time.perf_counter()
                first[fmt].append(((got_first or end) - start) * 1000)
                last[fmt].append((end - start) * 1000)
        for fmt, label in modes:
            rows.append(
                {
                    "response": label,
                    "first_byte_p50_ms": round(summary(first[fmt])["p50_ms"], 1),
                    "last_byte_p50_ms": round(summary(last[fmt])["p50_ms"], 1),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    eng = engine(args.requests) if args.requests else []
    if eng:
        print(table(eng, ["mode", "requests", "seconds", "req_per_s", "mean_batch"]))
    net = http(args.rounds)
    print(table(net, ["response", "first_byte_p50_ms", "last_byte_p50_ms"]))
    write_json(args.json, {"engine": eng, "http": net})


if __name__ == "__main__":
    main()
