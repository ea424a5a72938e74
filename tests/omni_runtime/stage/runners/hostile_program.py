"""A program for the ``subprocess`` stage's tests: ``hostile_program.py MODE OUTPUT [ARG...]``.

Every mode first records its pid (and the pid of a child it starts, where it starts one) as a
file in ``$PIDS_DIR``, so that a test can look for what is left. Modes:

- ``ok``: writes its arguments after OUTPUT and its standard input as JSON to OUTPUT.
- ``hang``: starts a child that sleeps, then sleeps itself, forever.
- ``sleep``: sleeps forever (no child).
- ``flood``: writes to its standard output without end.
- ``exit``: writes part of OUTPUT and a line to its standard error, then exits with status 3.
- ``huge``: writes OUTPUT without end.
- ``corrupt``: writes bytes that are no WAV file to OUTPUT.
- ``bomb``: writes a FLAC of silence to OUTPUT: 350 KB that decode to 1.3 GB of samples.
- ``link``: makes OUTPUT a symbolic link to a file outside its folder.
- ``stubborn``: ignores SIGTERM (and so does the child it starts), then sleeps forever.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def record(pid: int) -> None:
    folder = os.environ.get("PIDS_DIR")
    if folder:
        open(os.path.join(folder, str(pid)), "w").close()


def child(ignore_term: bool = False) -> None:
    code = "import signal, time\n"
    if ignore_term:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "time.sleep(3600)\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    record(proc.pid)


def main() -> None:
    mode, output, *rest = sys.argv[1:]
    record(os.getpid())
    if mode == "ok":
        with open(output, "w", encoding="utf-8") as f:
            json.dump({"argv": rest, "stdin": sys.stdin.read()}, f)
    elif mode == "hang":
        child()
        time.sleep(3600)
    elif mode == "sleep":
        time.sleep(3600)
    elif mode == "flood":
        line = b"x" * 65536
        while True:
            sys.stdout.buffer.write(line)
    elif mode == "exit":
        with open(output, "wb") as f:
            f.write(b"RIFF")
        print("boom: the model fell over", file=sys.stderr)
        sys.exit(3)
    elif mode == "huge":
        block = b"\0" * (1 << 20)
        with open(output, "wb") as f:
            while True:
                f.write(block)
                f.flush()
    elif mode == "corrupt":
        with open(output, "wb") as f:
            f.write(b"RIFF\x10\x00\x00\x00WAVEjunkjunkjunk" * 8)
    elif mode == "bomb":
        import numpy as np
        import soundfile

        silence = np.zeros((1 << 20, 8), np.int16)
        with soundfile.SoundFile(output, "w", samplerate=192_000, channels=8, format="FLAC") as f:
            for _ in range(40):
                f.write(silence)
    elif mode == "link":
        os.symlink("/etc/hostname", output)
    elif mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child(ignore_term=True)
        time.sleep(3600)
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
