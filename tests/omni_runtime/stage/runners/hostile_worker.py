"""A resident worker for the ``worker`` stage's tests: ``hostile_worker.py [START]``.

It records its pid as a file in ``$PIDS_DIR``. ``START`` is ``ready`` (the default), ``silent``
(never says ready), ``exit`` (exits before ready) or ``mute`` (closes its standard output and error
before ready, and lives on). Then each request acts by its ``params["mode"]``: ``ok`` (writes the
prompt upper-cased to its first output, with two progress lines), ``error`` (answers an error),
``die`` (exits with status 5 mid-request), ``hang`` (never answers, nor reads another line: a
cancel goes unanswered), ``flood`` (writes a line without end), ``huge`` (writes its output file
without end) or ``mute`` (closes its standard output and error, and lives on: it can answer
nothing more).
"""

from __future__ import annotations

import json
import os
import sys
import time


def say(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def mute() -> None:
    sys.stdout.flush()
    os.close(1)
    os.close(2)
    time.sleep(3600)


def main() -> None:
    folder = os.environ.get("PIDS_DIR")
    if folder:
        open(os.path.join(folder, str(os.getpid())), "w").close()
    start = sys.argv[1] if len(sys.argv) > 1 else "ready"
    if start == "silent":
        time.sleep(3600)
    if start == "exit":
        print("cannot load the weights", file=sys.stderr)
        sys.exit(7)
    if start == "mute":
        mute()
    print("a chatty library's banner on stdout")  # not the protocol: ignored
    say({"type": "ready"})
    for line in sys.stdin:
        message = json.loads(line)
        if message["type"] != "request":
            continue
        rid, mode = message["id"], message["params"].get("mode", "ok")
        if mode == "ok":
            for i in (1, 2):
                say({"type": "progress", "id": rid, "step": i, "steps": 2})
            for path in message["outputs"].values():
                with open(path, "w", encoding="utf-8") as f:
                    f.write(message["prompt"].upper())
            say({"type": "output", "id": rid})
        elif mode == "error":
            say({"type": "error", "id": rid, "message": "bad input for this model"})
        elif mode == "die":
            print("segfault in the model", file=sys.stderr, flush=True)
            os._exit(5)
        elif mode == "hang":
            time.sleep(3600)
        elif mode == "mute":
            mute()
        elif mode == "flood":
            while True:
                sys.stdout.write("x" * 65536)
        elif mode == "huge":
            path = next(iter(message["outputs"].values()))
            with open(path, "wb") as f:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()


if __name__ == "__main__":
    main()
