"""Realtime sessions: time from the end of the user's speech to the first audio byte of the answer.

A real ``omni-runtime serve tiny-omni-voice`` (a tiny Whisper hears the turn, the tiny LM answers,
a tiny VITS speaks the answer) and real WebSocket clients (``WS /v1/realtime``). Each session
appends a spoken turn (a tone, 100 ms a message), then commits it with ``response.create`` (turn
detection off: the commit is the end of speech); the time is from that commit to the first
``response.audio.delta``, and to ``response.done``. One load runs one session; the other runs
``--concurrency`` sessions at once. Both loads run on the same server, alternating, after a
warm-up; the figure is the ratio of their first-audio times (p50 and p90).

Two ways a session goes (``--mode``), both run by default:

- ``conversation``: as people talk. The turn's audio streams at its own pace (100 ms a message),
  the session then listens to the whole answer (its audio's length, from its first byte) before it
  speaks again, and the sessions start at seeded random moments within the first turn's length.
- ``back-to-back``: the worst case. Each session sends its next turn the moment an answer is done,
  the audio all at once: the server is never idle, so the time grows with the work queued ahead
  (a closed loop's latency is the sessions over the throughput).
- ``vad``: as ``conversation``, but the server's voice activity detection ends the turn: the
  session goes on sending silence at its pace, and the time runs from the end of its speech (the
  last voiced piece sent) to the first audio byte, so it includes the detector's
  :data:`VAD_SILENCE_MS`. Run twice, one after the other: with the input heard as it arrives
  (``heard``: a pause of :data:`SEGMENT_MS` ends a segment, transcribed while the detector still
  waits) and with it off (``whole``: the response transcribes the turn first).

With ``--whisper base`` the pipeline hears with a Whisper of base's size (random weights, built
into a temporary directory) in place of the tiny one, so recognition costs what a real one does.

    python -m benchmarks.realtime [--turns 16] [--concurrency 8] [--rounds 2] [--whisper tiny|base] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from websockets.asyncio.client import ClientConnection, connect

from benchmarks._common import REPO, Server, pct, table, write_json

#: The rate of the audio both ways.
RATE = 16_000
#: Each append carries this much audio (a microphone's pace).
PIECE_MS = 100
#: ``vad`` mode: the silence that ends a turn, and the pause that ends a segment.
VAD_SILENCE_MS, SEGMENT_MS = 400, 200


def spoken_turn(seconds: float, rate: int = RATE) -> list[str]:
    """A turn of ``seconds`` (a 220 Hz tone with a slow swell) as base64 pcm16 pieces of
    :data:`PIECE_MS`."""
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * 220 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    pcm = np.round(wave * 32767).astype("<i2").tobytes()
    step = rate * PIECE_MS // 1000 * 2
    return [base64.b64encode(pcm[i : i + step]).decode() for i in range(0, len(pcm), step)]


@dataclass
class Turn:
    """One answered turn's times from its commit (s)."""

    first_audio: float
    done: float
    audio_bytes: int


@dataclass
class Load:
    concurrency: int
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0

    def row(self) -> dict[str, Any]:
        first = [t.first_audio * 1000 for t in self.turns]
        done = [t.done * 1000 for t in self.turns]
        return {
            "sessions": self.concurrency,
            "turns": len(self.turns),
            "first_audio_p50_ms": pct(first, 50),
            "first_audio_p90_ms": pct(first, 90),
            "done_p50_ms": pct(done, 50),
            "turns_per_s": len(self.turns) / self.wall_s if self.wall_s else float("nan"),
        }


async def _recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(await asyncio.wait_for(ws.recv(), 60))


async def open_session(
    url: str, headers: dict[str, str], max_tokens: int, mode: str = "back-to-back", hearing: bool = True
) -> ClientConnection:
    ws = await connect(url, additional_headers=headers, max_size=None)
    first = await _recv(ws)
    if first["type"] != "session.created":
        raise RuntimeError(f"the session was refused: {first}")
    settings: dict[str, Any] = {
        "input_sample_rate": RATE,
        "output_sample_rate": RATE,
        "max_response_output_tokens": max_tokens,
        "input_audio_transcription": {"segment_silence_ms": SEGMENT_MS} if hearing else None,
    }
    if mode == "vad":
        settings["turn_detection"] = {"type": "server_vad", "silence_duration_ms": VAD_SILENCE_MS}
    await ws.send(json.dumps({"type": "session.update", "session": settings}))
    await _recv(ws)
    return ws


async def one_turn(ws: ClientConnection, pieces: list[str], mode: str) -> Turn:
    """Append the turn (at the audio's own pace but ``back-to-back``); then commit it and ask for
    the answer (``vad``: send silence at its pace until the server does both). The times from the
    commit (``vad``: from the end of the speech)."""
    paced = mode != "back-to-back"
    for piece in pieces:
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": piece}))
        if paced:
            await asyncio.sleep(PIECE_MS / 1000)
    t0 = time.perf_counter()
    silence: asyncio.Task[None] | None = None
    if mode == "vad":
        silence = asyncio.create_task(_silence(ws))
    else:
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        await ws.send(json.dumps({"type": "response.create"}))
    first_audio = None
    audio_bytes = 0
    try:
        while True:
            event = await _recv(ws)
            kind = event["type"]
            if kind == "response.audio.delta":
                if first_audio is None:
                    first_audio = time.perf_counter() - t0
                    if silence is not None:
                        silence.cancel()
                audio_bytes += len(base64.b64decode(event["delta"]))
            elif kind == "error":
                raise RuntimeError(f"the turn failed: {event['error']}")
            elif kind == "response.done":
                if event["response"]["status"] != "completed" or first_audio is None:
                    raise RuntimeError(f"the turn ended without audio: {event['response']}")
                return Turn(first_audio, time.perf_counter() - t0, audio_bytes)
    finally:
        if silence is not None:
            silence.cancel()


async def _silence(ws: ClientConnection) -> None:
    """Silence at its pace (a microphone that stays open), until cancelled."""
    quiet = base64.b64encode(bytes(2 * RATE * PIECE_MS // 1000)).decode()
    while True:
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": quiet}))
        await asyncio.sleep(PIECE_MS / 1000)


async def run_load(
    url: str,
    headers: dict[str, str],
    concurrency: int,
    turns: int,
    pieces: list[str],
    max_tokens: int,
    mode: str = "back-to-back",
    seed: int = 0,
    hearing: bool = True,
) -> Load:
    """``turns`` turns over ``concurrency`` sessions at once (each one turn after another, as
    ``mode`` says)."""
    load = Load(concurrency)
    sessions = [await open_session(url, headers, max_tokens, mode, hearing) for _ in range(concurrency)]
    todo = list(range(turns))
    paced = mode != "back-to-back"
    starts = random.Random(seed)

    async def session(ws: ClientConnection) -> None:
        if paced:
            await asyncio.sleep(starts.uniform(0, len(pieces) * PIECE_MS / 1000))
        while todo:
            todo.pop()
            turn = await one_turn(ws, pieces, mode)
            load.turns.append(turn)
            if paced:  # listen to the rest of the answer before speaking again
                await asyncio.sleep(max(0.0, turn.audio_bytes / 2 / RATE - (turn.done - turn.first_audio)))

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(session(ws) for ws in sessions))
        load.wall_s = time.perf_counter() - t0
    finally:
        for ws in sessions:
            await ws.close()
    return load


async def measure(
    url: str,
    headers: dict[str, str],
    *,
    turns: int,
    concurrency: int,
    rounds: int,
    mode: str = "back-to-back",
    seconds: float = 1.0,
    max_tokens: int = 16,
    hearing: bool = True,
) -> dict[str, Any]:
    """Both loads (1 session, ``concurrency`` sessions) on the server at ``url``, ``rounds`` times
    each, alternating which goes first, after a warm-up; the rows and the ratios. ``hearing``:
    the sessions' input is transcribed as it arrives."""
    pieces = spoken_turn(seconds)
    await run_load(url, headers, min(concurrency, 2), 2 * min(concurrency, 2), pieces, max_tokens)  # warm-up
    merged = {c: Load(c) for c in (1, concurrency)}
    for r in range(rounds):
        for c in (1, concurrency) if r % 2 == 0 else (concurrency, 1):
            load = await run_load(url, headers, c, turns, pieces, max_tokens, mode, seed=r, hearing=hearing)
            merged[c].turns += load.turns
            merged[c].wall_s += load.wall_s
    name = mode if mode != "vad" else f"vad, {'heard' if hearing else 'whole'}"
    rows = [{"mode": name, **merged[c].row()} for c in (1, concurrency)]
    one, many = rows
    ratios = {
        "mode": name,
        "first_audio_p50_ratio": many["first_audio_p50_ms"] / one["first_audio_p50_ms"],
        "first_audio_p90_ratio": many["first_audio_p90_ms"] / one["first_audio_p90_ms"],
        "throughput_ratio": many["turns_per_s"] / one["turns_per_s"],
    }
    return {"rows": rows, "ratios": ratios, "turns": turns, "rounds": rounds, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=16, help="turns per load and round")
    parser.add_argument(
        "--mode", choices=("conversation", "back-to-back", "vad", "all"), default="all", help="how the sessions talk"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="sessions at once in the second load")
    parser.add_argument("--rounds", type=int, default=2, help="times each load runs")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each spoken turn")
    parser.add_argument("--max-tokens", type=int, default=16, help="the answer's text tokens")
    parser.add_argument("--model", default="tiny-omni-voice", help="the served model (one that takes audio)")
    parser.add_argument(
        "--whisper", choices=("tiny", "base"), default="tiny", help="the recogniser's size (tiny-omni-voice only)"
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        model = args.model
        if args.whisper == "base":
            model = _with_base_whisper(Path(stack.enter_context(tempfile.TemporaryDirectory())))
        server = stack.enter_context(Server(model, "--realtime-sessions", str(max(args.concurrency, 2))))
        url = server.url.replace("http://", "ws://") + "/v1/realtime"
        modes = ("conversation", "back-to-back", "vad") if args.mode == "all" else (args.mode,)
        loads = {"turns": args.turns, "concurrency": args.concurrency, "rounds": args.rounds}
        shape = {"seconds": args.seconds, "max_tokens": args.max_tokens}
        runs = [
            asyncio.run(measure(url, {}, mode=mode, hearing=hearing, **loads, **shape))
            for mode in modes
            for hearing in ((True, False) if mode == "vad" else (True,))
        ]
    rows = [row for run in runs for row in run["rows"]]
    ratios = [run["ratios"] for run in runs]
    print(table(rows, list(rows[0])))
    print()
    print(table(ratios, list(ratios[0])))
    write_json(args.json, {"runs": runs, "cpus": os.cpu_count(), "model": args.model, "whisper": args.whisper})


def _with_base_whisper(tmp: Path) -> str:
    """tiny-omni-voice's config with a base-sized Whisper built into ``tmp``: the config's path."""
    from omni_runtime.models.tiny_whisper import BASE, build_tiny_whisper

    build_tiny_whisper(tmp / "whisper", BASE)
    config = yaml.safe_load((REPO / "stage_configs" / "tiny-omni-voice.yaml").read_text())
    config["model"] = "tiny-omni-voice"
    config["stage_args"][0]["model"] = str(tmp / "whisper")
    path = tmp / "voice.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


if __name__ == "__main__":
    main()
