"""A speech stage's memory over rounds of varied-length requests, with and without
``engine_args.return_freed_memory``, side by side in one run (``tiny-tts``).

Two engines on the bundled ``tiny-tts`` config, one with ``return_freed_memory: false`` (before)
and one with the default ``true`` (after), both started before any load. Each round draws N requests
(2 to 24 words, at most 140 characters, speed 0.8 to 1.5, one of four voices: clips of about 1 to
20 s, within the default ``max_speech_seconds``), submits them all at once to one engine, then
the same requests to the other, the order alternating between rounds. ``--mixed`` adds the soak's
mix: 15 % cancelled by the caller after 0 to 1 s and 10 % with a 0.2 to 1 s deadline. After each
round (nothing running or queued) it prints each stage process's RSS and anonymous RSS, this
process's RSS (the engines' shared parent: orchestrators and callers) and the round's seconds.
A leak grows every round; a cache or a high-water mark levels off.

    python -m benchmarks.speech_memory [--requests 30] [--rounds 10] [--mixed] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from benchmarks._common import table, write_json
from benchmarks.audio import WORDS
from omni_runtime import AsyncOmni

VOICES = ("alloy", "echo", "nova", "onyx")
SPEEDS = (0.8, 1.0, 1.2, 1.5)
MIB = 1 << 20


def plans(rng: random.Random, n: int, base: int, mixed: bool) -> list[dict[str, Any]]:
    """One round's requests; the same list goes to both engines."""
    out = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 24)))[:140]
        params: dict[str, Any] = {"seed": base + i, "speed": rng.choice(SPEEDS), "voice": rng.choice(VOICES)}
        roll = rng.random()
        cancel_after = None
        if mixed and roll < 0.15:
            cancel_after = rng.uniform(0.0, 1.0)
        elif mixed and roll < 0.25:
            params["timeout"] = rng.uniform(0.2, 1.0)
        out.append({"text": text, "params": params, "cancel_after": cancel_after})
    return out


async def _consume(engine: AsyncOmni, text: str, params: dict[str, Any]) -> None:
    async for _ in engine.generate(text, params):
        pass


async def _one(engine: AsyncOmni, plan: dict[str, Any]) -> str:
    task = asyncio.ensure_future(_consume(engine, plan["text"], plan["params"]))
    if plan["cancel_after"] is not None:
        await asyncio.sleep(plan["cancel_after"])
        task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    except Exception as e:  # a deadline that passed is part of the mix; anything else is reported
        return type(e).__name__
    return "ok"


def proc_mib(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and RssAnon of a process, in MiB (``/proc/PID/status``)."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                found[key] = int(value.split()[0]) // 1024
    return found


class Subject:
    """One engine under test and its stage process."""

    def __init__(self, label: str, fix: bool) -> None:
        self.label = label
        self.engine = AsyncOmni("tiny-tts", return_freed_memory=fix)
        self.pid = 0

    async def start(self) -> None:
        [pong] = await self.engine.collective_rpc("ping")
        self.pid = pong.result["pid"]
        # Warm-up: round 0 is not the model's first forward.
        await _one(self.engine, {"text": "warm up", "params": {"seed": 0}, "cancel_after": None})

    async def round(self, requests: list[dict[str, Any]]) -> dict[str, Any]:
        start = time.monotonic()
        outcomes = await asyncio.gather(*(_one(self.engine, p) for p in requests))
        seconds = time.monotonic() - start
        [stats] = await self.engine.collective_rpc("get_stats")
        assert stats.result["running"] == 0 and stats.result["queue_len"] == 0, stats.result
        mem = proc_mib(self.pid)
        return {
            "rss": mem["VmRSS"],
            "anon": mem["RssAnon"],
            "s": round(seconds, 1),
            "fixed": stats.result["mmap_threshold_fixed"],
            "ok": sum(o == "ok" for o in outcomes),
        }

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)


async def run(n: int, rounds: int, mixed: bool) -> list[dict[str, Any]]:
    parent_start = proc_mib()["VmRSS"]
    subjects = [Subject("off", fix=False), Subject("on", fix=True)]
    rows: list[dict[str, Any]] = []
    try:
        for s in subjects:
            await s.start()
        first = {s.label: proc_mib(s.pid)["VmRSS"] for s in subjects}
        print(
            f"parent {parent_start} MiB before the engines; after start-up and warm-up: parent "
            f"{proc_mib()['VmRSS']} MiB, stage off {first['off']} MiB, stage on {first['on']} MiB",
            flush=True,
        )
        rng = random.Random(0)
        for r in range(rounds):
            requests = plans(rng, n, r * n, mixed)
            order = subjects if r % 2 == 0 else subjects[::-1]
            got = {s.label: await s.round(requests) for s in order}
            row = {"round": r, **{f"{k}_{label}": v for label, res in got.items() for k, v in res.items()}}
            row["parent_rss"] = proc_mib()["VmRSS"]
            rows.append(row)
            print(
                f"round {r}: stage RSS off {row['rss_off']} MiB / on {row['rss_on']} MiB "
                f"(anon {row['anon_off']} / {row['anon_on']}), parent {row['parent_rss']} MiB, "
                f"{row['s_off']} s / {row['s_on']} s, served {row['ok_off']} / {row['ok_on']} of {n} "
                f"(threshold fixed: {row['fixed_off']} / {row['fixed_on']})",
                flush=True,
            )
    finally:
        for s in subjects:
            await s.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=30, help="requests per round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--mixed", action="store_true", help="cancel 15 %% and give 10 %% a short deadline")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = asyncio.run(run(args.requests, args.rounds, args.mixed))
    columns = ["round", "rss_off", "rss_on", "anon_off", "anon_on", "parent_rss", "s_off", "s_on"]
    print(table(rows, columns))
    write_json(args.json, {"requests": args.requests, "mixed": args.mixed, "rounds": rows})


if __name__ == "__main__":
    main()
