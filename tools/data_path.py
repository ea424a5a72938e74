"""The data path of a request through the gateway, traced: which project functions run, in which
files and threads, and where the request crosses a thread or process.

    .venv/bin/python tools/data_path.py [--out FILE]

Serves tiny-sd, tiny-tts and tiny-wan in this process (the stages in their own processes), sends
one images request, one speech request and one video job over an in-process ASGI transport, and
records every call of a function of ``omni_runtime`` or ``entrypoints`` made in this process
(the server's loop and the orchestrator's thread) while each one runs. Calls inside a stage
process are not traced: they are one crossing each way (the stage's socket). The report lists, per
request, the functions in first-call order with their thread, and the counts: functions, files,
thread crossings. Used to compare the path before and after a change of the serving layers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PROJECT = (str(REPO / "omni_runtime") + "/", str(REPO / "entrypoints") + "/")


class Recorder:
    """Records, while on, the first call of every project function per thread."""

    def __init__(self) -> None:
        self.on = False
        self.calls: list[tuple[str, str, str]] = []  # (thread, file, qualified name)
        self._seen: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(PROJECT):
            return
        thread = threading.current_thread().name
        if "orchestrator" in thread.lower():
            thread = "orchestrator"
        elif thread == "MainThread":
            thread = "gateway"
        key = (thread, str(Path(path).relative_to(REPO)), frame.f_code.co_qualname)
        with self._lock:
            if key not in self._seen:
                self._seen.add(key)
                self.calls.append(key)

    def take(self) -> list[tuple[str, str, str]]:
        with self._lock:
            calls, self.calls, self._seen = self.calls, [], set()
        return calls


def summary(name: str, calls: list[tuple[str, str, str]]) -> dict[str, Any]:
    crossings, last = 0, None
    for thread, _, _ in calls:
        if last is not None and thread != last:
            crossings += 1
        last = thread
    return {
        "request": name,
        "functions": len({(f, q) for _, f, q in calls}),
        "files": sorted({f for _, f, _ in calls}),
        "thread_switches_in_first_call_order": crossings,
        "calls": [f"{t}: {f}:{q}" for t, f, q in calls],
    }


async def main(out: Path | None) -> int:
    import httpx
    from omni_runtime.entrypoints.multi_omni import ModelSpec
    from omni_runtime.entrypoints.openai.server import create_app

    recorder = Recorder()
    sys.setprofile(recorder.profile)
    threading.setprofile(recorder.profile)
    app = create_app([ModelSpec(source=s) for s in ("tiny-sd", "tiny-tts", "tiny-wan")])
    reports: list[dict[str, Any]] = []
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=300) as client:
            for _ in range(600):  # the models load in the background
                if (await client.get("/readyz")).status_code == 200:
                    break
                await asyncio.sleep(0.5)

            async def traced(name: str, send: Callable[[], Any]) -> None:
                recorder.on = True
                try:
                    response = await send()
                finally:
                    recorder.on = False
                report = summary(name, recorder.take())
                report["status"] = response.status_code
                if response.status_code >= 300:
                    report["error"] = response.text[:300]
                reports.append(report)

            image = {"model": "tiny-sd", "prompt": "a red cube", "size": "64x64", "n": 1}
            speech = {"model": "tiny-tts", "input": "hello there", "voice": "alloy"}
            await client.post("/v1/images/generations", json=image)  # warm: first-call imports
            await traced("images", lambda: client.post("/v1/images/generations", json=image))
            await traced("speech", lambda: client.post("/v1/audio/speech", json=speech))

            async def video_job() -> Any:
                made = await client.post("/v1/videos", json={"model": "tiny-wan", "prompt": "waves", "size": "32x32"})
                assert made.status_code < 300, made.text
                video_id = made.json()["id"]
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline:
                    got = await client.get(f"/v1/videos/{video_id}")
                    if got.json().get("status") in ("completed", "failed"):
                        return await client.get(f"/v1/videos/{video_id}/content")
                    await asyncio.sleep(0.2)
                raise TimeoutError(video_id)

            await traced("video job", video_job)
    sys.setprofile(None)
    threading.setprofile(None)
    text = json.dumps(reports, indent=1)
    if out:
        out.write_text(text)
    for r in reports:
        error = f"; {r['error']}" if "error" in r else ""
        print(
            f"{r['request']} ({r['status']}): {r['functions']} functions in {len(r['files'])} files, "
            f"{r['thread_switches_in_first_call_order']} thread switches{error}"
        )
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    sys.exit(asyncio.run(main(parser.parse_args().out)))
