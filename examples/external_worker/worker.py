#!/usr/bin/env python3
"""A resident worker for an omni_runtime ``stage_type: worker`` stage, in plain Python.

Copy this file into (or beside) the repository you want to serve, and change two functions:
``load_model`` (import the repository, load its weights once) and ``run`` (one request: write the
declared output files, return the text if any). Run it with that repository's own interpreter
(``runner_args.python`` names another virtualenv's); it imports nothing from omni_runtime.

The protocol is JSON, one object per line (docs/configuration.md, "External programs"):

- it writes ``{"type": "ready", "max_batch": 1}`` to its standard output once loaded;
- it reads ``{"type": "request", "id", "prompt", "params", "workdir", "outputs"}`` (``outputs``:
  each declared output's name -> the path to write it at) and ``{"type": "cancel", "id"}`` on
  its standard input;
- it answers each request with ``{"type": "output", "id", "text"}`` (its files written) or
  ``{"type": "error", "id", "message"}``, and may say ``{"type": "progress", "id", "step",
  "steps"}`` on the way.

Everything else it prints goes to standard error (``print`` is redirected there below), so a
chatty repository cannot break the protocol. This example's "model" upper-cases the prompt in
``params["steps"]`` steps of ``params["delay_ms"]`` each, checking for a cancel between steps.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from typing import Any, TextIO

#: The protocol's channel; ``print`` and the wrapped code's logs go to standard error instead.
PROTOCOL: TextIO = sys.stdout
sys.stdout = sys.stderr
_WRITE = threading.Lock()


def say(message: dict[str, Any]) -> None:
    """Write one protocol line."""
    with _WRITE:
        PROTOCOL.write(json.dumps(message) + "\n")
        PROTOCOL.flush()


def load_model() -> Any:
    """Load the model once (replace: import your repository, read its weights)."""
    return str.upper


def run(model: Any, prompt: str, params: dict[str, Any], outputs: dict[str, str], step: Any) -> str | None:
    """One request (replace with your repository's call). Write each of ``outputs``; call
    ``step(i, n)`` as it goes (it raises ``Cancelled`` once the request is cancelled)."""
    steps = int(params.get("steps", 3))
    for i in range(steps):
        time.sleep(float(params.get("delay_ms", 0)) / 1000)
        step(i + 1, steps)
    answer = model(prompt)
    for path in outputs.values():
        with open(path, "w", encoding="utf-8") as f:
            f.write(answer)
    return None  # the text comes back through the declared output file


class Cancelled(Exception):
    pass


def main() -> None:
    model = load_model()
    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
    cancelled: set[str] = set()

    def read() -> None:
        # Cancels are seen while a request runs: the reader is a thread of its own.
        for line in sys.stdin:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("type") == "cancel":
                cancelled.add(message["id"])
            else:
                inbox.put(message)
        inbox.put(None)  # the runtime closed our input: stop

    threading.Thread(target=read, daemon=True).start()
    say({"type": "ready", "max_batch": 1})
    while (message := inbox.get()) is not None:
        if message.get("type") != "request":
            continue
        rid = message["id"]

        def step(i: int, n: int, rid: str = rid) -> None:
            if rid in cancelled:
                raise Cancelled
            say({"type": "progress", "id": rid, "step": i, "steps": n})

        try:
            text = run(model, message["prompt"], message["params"], message["outputs"], step)
        except Cancelled:
            say({"type": "error", "id": rid, "message": "cancelled"})
        except Exception as e:  # this request fails; the worker serves on
            say({"type": "error", "id": rid, "message": f"{type(e).__name__}: {e}"})
        else:
            say({"type": "output", "id": rid, "text": text})
        cancelled.discard(rid)


if __name__ == "__main__":
    main()
