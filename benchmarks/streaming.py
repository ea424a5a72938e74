"""Streaming between stages: how soon the first audio comes with a chunked hand-off.

``handoff``: the tiny text -> speech pipeline (tiny-omni-speech: the speech stage waits for the
whole answer) against the same pipeline with a sentence-chunked speech stage
(tiny-omni-speech-chunked), one engine each, both started and warmed before any load, then each
load run on each in turn: time to first text token, time to first audio, full time (p50 / p90),
at concurrency 1 and 8 (closed loop), and throughput (requests/s) at 8; the ratios side by side.

    python -m benchmarks.streaming --handoff [--requests 24] [--max-tokens 128] [--json out.json]

Parts are functions selected by flags, so other parts (the text stage under Poisson arrivals)
sit beside this one in the same ``main``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.entrypoints.async_omni import AsyncOmni

from benchmarks._common import pct, table, write_json

PROMPTS = [
    "tell me about the sea",
    "describe a long walk in the hills",
    "what is the weather like today",
    "say something about trains",
]


@dataclass
class Timings:
    """One request's times from its submission (s)."""

    first_text: float | None = None
    first_audio: float | None = None
    total: float = 0.0


@dataclass
class LoadResult:
    config: str
    concurrency: int
    timings: list[Timings] = field(default_factory=list)
    wall_s: float = 0.0

    def row(self) -> dict[str, Any]:
        def ms(values: list[float | None], q: float) -> float:
            return pct([v * 1000 for v in values if v is not None], q)

        first_text = [t.first_text for t in self.timings]
        first_audio = [t.first_audio for t in self.timings]
        total: list[float | None] = [t.total for t in self.timings]
        return {
            "config": self.config,
            "c": self.concurrency,
            "ttft_p50_ms": ms(first_text, 50),
            "ttfa_p50_ms": ms(first_audio, 50),
            "ttfa_p90_ms": ms(first_audio, 90),
            "full_p50_ms": ms(total, 50),
            "full_p90_ms": ms(total, 90),
            "req_per_s": len(self.timings) / self.wall_s if self.wall_s else float("nan"),
        }


async def long_answers(omni: AsyncOmni, count: int, max_tokens: int) -> list[tuple[str, int]]:
    """``count`` (prompt, seed) pairs whose answer runs to ``max_tokens`` (the tiny random LM often
    ends early; a benchmark of hand-off needs answers of one known length). Text only."""
    found: list[tuple[str, int]] = []
    seed = 0
    while len(found) < count and seed < 50 * count:
        batch = [(PROMPTS[(seed + i) % len(PROMPTS)], seed + i) for i in range(8)]
        seed += 8

        async def length(prompt: str, s: int) -> int:
            params = omni.sampling_params(shared={"max_tokens": max_tokens, "seed": s})
            async for out in omni.generate(prompt, params, modalities=["text"]):
                pass
            return int(out.outputs_by_stage[0].metrics.get("completion_tokens") or 0)

        lengths = await asyncio.gather(*(length(p, s) for p, s in batch))
        found += [pair for pair, n in zip(batch, lengths, strict=True) if n >= max_tokens]
    if len(found) < count:
        raise RuntimeError(f"only {len(found)} answers of {max_tokens} tokens among {seed} seeds")
    return found[:count]


async def one_request(omni: AsyncOmni, prompt: str, max_tokens: int, seed: int) -> Timings:
    t0 = time.perf_counter()
    timings = Timings()
    params = omni.sampling_params(shared={"max_tokens": max_tokens, "seed": seed})
    async for out in omni.generate(prompt, params):
        now = time.perf_counter() - t0
        if timings.first_text is None and out.text_delta:
            timings.first_text = now
        if timings.first_audio is None and (out.media_delta or out.audios):
            timings.first_audio = now
    timings.total = time.perf_counter() - t0
    return timings


async def closed_loop(
    omni: AsyncOmni, name: str, concurrency: int, work: list[tuple[str, int]], max_tokens: int
) -> LoadResult:
    """Every (prompt, seed) of ``work``, ``concurrency`` in flight at a time."""
    result = LoadResult(name, concurrency)
    todo = list(work)

    async def worker() -> None:
        while todo:
            prompt, seed = todo.pop()
            result.timings.append(await one_request(omni, prompt, max_tokens, seed))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.wall_s = time.perf_counter() - t0
    return result


async def handoff(requests: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    """Whole-output vs chunked hand-off: every load on both engines, in turn."""
    engines = {name: AsyncOmni(name) for name in ("tiny-omni-speech", "tiny-omni-speech-chunked")}
    try:
        work = await long_answers(engines["tiny-omni-speech"], requests, max_tokens)
        for omni in engines.values():  # warm-up: the first forwards of each stage
            await closed_loop(omni, "warm-up", 2, work[:4], max_tokens)
        results: list[LoadResult] = []
        for concurrency in (1, 8):
            merged = {name: LoadResult(name, concurrency) for name in engines}
            for r in range(rounds):
                order = list(engines.items())[r % 2 :] + list(engines.items())[: r % 2]
                for name, omni in order:
                    res = await closed_loop(omni, name, concurrency, work, max_tokens)
                    merged[name].timings += res.timings
                    merged[name].wall_s += res.wall_s
            results += merged.values()
    finally:
        for omni in engines.values():
            omni.close()
    rows = [r.row() for r in results]
    print(table(rows, list(rows[0])))
    ratios = []
    for c in (1, 8):
        whole, chunked = (next(r for r in rows if r["c"] == c and r["config"] == n) for n in engines)
        ratios.append(
            {
                "c": c,
                "ttfa_whole_over_chunked": whole["ttfa_p50_ms"] / chunked["ttfa_p50_ms"],
                "full_whole_over_chunked": whole["full_p50_ms"] / chunked["full_p50_ms"],
                "throughput_chunked_over_whole": chunked["req_per_s"] / whole["req_per_s"],
            }
        )
    print()
    print(table(ratios, list(ratios[0])))
    return {"rows": rows, "ratios": ratios, "requests": requests, "max_tokens": max_tokens, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--handoff", action="store_true", help="chunked vs whole-output hand-off (text -> speech)")
    parser.add_argument("--requests", type=int, default=24, help="requests per load and round")
    parser.add_argument("--rounds", type=int, default=2, help="times each load runs on each engine")
    parser.add_argument("--max-tokens", type=int, default=128, help="the text stage's answer length")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if not args.handoff:
        parser.error("choose a part: --handoff")
    figures: dict[str, Any] = {}
    if args.handoff:
        figures["handoff"] = asyncio.run(handoff(args.requests, args.max_tokens, args.rounds))
    write_json(args.json, figures)


if __name__ == "__main__":
    main()
