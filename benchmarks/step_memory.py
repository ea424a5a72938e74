"""A step-mode stage's memory over rounds of requests with aborts and deadlines (tiny-sd).

Each round sends N requests at once: sizes 32, 64 and 128 px, priorities 0..3, half of them with
float (``np``) outputs (128 px ones go through shared memory), 15 % with a deadline of 0.05..1 s,
15 % cancelled by the caller after 0..1 s. After each round (nothing running or queued) it prints
the stage process's RSS, USS (its private memory) and shared memory. A leak grows every round;
an allocator's high-water mark or a pool levels off.

    python -m benchmarks.step_memory [N] [ROUNDS]     # default 200 requests, 8 rounds
"""

from __future__ import annotations

import asyncio
import random
import sys
import time

import psutil

from omni_runtime import AsyncOmni


async def _consume(engine: AsyncOmni, prompt: str, params: dict) -> None:
    async for _ in engine.generate(prompt, params):
        pass


async def _one(engine: AsyncOmni, i: int, rng: random.Random) -> None:
    size = rng.choice([32, 64, 128])
    params = {"seed": i, "height": size, "width": size, "priority": rng.randint(0, 3), "num_inference_steps": 3}
    params["output_type"] = rng.choice(["pil", "np"])
    kind = rng.random()
    if kind < 0.15:
        params["timeout"] = rng.uniform(0.05, 1.0)
    task = asyncio.ensure_future(_consume(engine, f"prompt {i}", params))
    if kind > 0.85:
        await asyncio.sleep(rng.uniform(0, 1.0))
        task.cancel()
    try:
        await task
    except BaseException:  # the deadlines and cancellations are the point
        pass


async def main(n: int, rounds: int) -> None:
    engine = AsyncOmni("tiny-sd", max_pending=4096, step_execution=True, max_num_seqs=8, torch_threads=1)
    [pong] = await engine.collective_rpc("ping")
    stage = psutil.Process(pong.result["pid"])
    rng = random.Random(0)
    try:
        for r in range(rounds):
            start = time.monotonic()
            await asyncio.gather(*(_one(engine, r * n + i, rng) for i in range(n)))
            mem = stage.memory_full_info()
            [stats] = await engine.collective_rpc("get_stats")
            mib = 1 << 20
            print(
                f"round {r}: {time.monotonic() - start:.0f} s, rss {mem.rss // mib} MiB, uss {mem.uss // mib} MiB, "
                f"shared {mem.shared // mib} MiB, running {stats.result['running']}, "
                f"queued {stats.result['queue_len']}",
                flush=True,
            )
    finally:
        await asyncio.get_running_loop().run_in_executor(None, engine.close)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 200, int(sys.argv[2]) if len(sys.argv) > 2 else 8))
