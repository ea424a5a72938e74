"""SIGTERM to ``omni-runtime serve`` under load: every request in flight finishes (or gets a clear
error), new connections are refused, the process exits 0, and it leaves nothing behind: no stage
process, no shared-memory segment, no socket file.

Each request uses a connection of its own, so a refused connection means the request was never
admitted. A connection the server accepted in the last instant before its listener closed, but
whose request it had not read yet, is closed without a response (as any server closes idle
connections when it stops): allowed only for requests sent just before the signal, and only if
the server's access log shows it answered every request it read. Any other transport error would
be a request dropped on the floor.
"""

from __future__ import annotations

import glob
import os
import signal
import threading
import time
from dataclasses import dataclass

import httpx
import psutil

from tests.entrypoints.openai.server_process import start_server, write_config
from tests.reliability.support import http_config

CLIENTS = 16
DELAY_MS = 300


@dataclass
class Outcome:
    kind: str
    sent: float
    done: float
    status: int | None = None
    error: str | None = None


def one_request(http: httpx.Client, i: int) -> tuple[int, bool]:
    """Send request ``i`` (chat or images, in turn) on a fresh connection; (status, content ok)."""
    close = {"Connection": "close"}
    if i % 2:
        body = {"messages": [{"role": "user", "content": f"load {i}"}], "modalities": ["text"]}
        resp = http.post("/v1/chat/completions", json=body, headers=close)
        ok = resp.status_code != 200 or resp.json()["choices"][0]["message"]["content"] == f"load {i}"
    else:
        resp = http.post("/v1/images/generations", json={"prompt": f"load {i}", "n": 2}, headers=close)
        ok = resp.status_code != 200 or len(resp.json()["data"]) == 2
    if resp.status_code != 200:
        ok = bool(resp.json()["error"]["message"])  # a clear error: the OpenAI error shape
    return resp.status_code, ok


def load(http: httpx.Client, stop: threading.Event, outcomes: list[Outcome], worker: int) -> None:
    i = worker
    while not stop.is_set():
        sent = time.monotonic()
        try:
            status, ok = one_request(http, i)
            outcomes.append(Outcome("answer" if ok else "bad answer", sent, time.monotonic(), status=status))
        except httpx.ConnectError:
            outcomes.append(Outcome("refused", sent, time.monotonic()))
            return  # the listener is closed: the server is on its way out
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            # Closed before a response: unread (see above) if the server closed or reset it.
            unread = "without sending a response" in str(e) or "reset by peer" in str(e)
            outcomes.append(Outcome("unread" if unread else "dropped", sent, time.monotonic(), error=str(e)))
            continue
        except Exception as e:
            outcomes.append(Outcome("dropped", sent, time.monotonic(), error=f"{type(e).__name__}: {e}"))
        i += CLIENTS


def ipc_dirs_of(processes: list[psutil.Process]) -> set[str]:
    dirs = set()
    for p in processes:
        for conn in p.net_connections(kind="unix"):
            for path in (conn.laddr, conn.raddr):
                if path and "omni_runtime-ipc-" in path:
                    dirs.add(os.path.dirname(path))
    return dirs


def test_sigterm_under_load_drains_exits_0_and_leaves_nothing(tmp_path):
    config = write_config(tmp_path / "server.yaml", http_config(delay_ms=DELAY_MS))
    server = start_server(str(config), "--access-log", log=tmp_path / "server.log")
    try:
        stages = [p for p in server.children() if "omni_runtime.stage.process" in " ".join(p.cmdline())]
        assert len(stages) == 2
        ipc_dirs = ipc_dirs_of([psutil.Process(server.proc.pid)])  # it binds the stage sockets
        assert len(ipc_dirs) == 1 and glob.glob(f"{next(iter(ipc_dirs))}/*")
        shm_prefix = f"omni_rt-{server.proc.pid}-"

        outcomes: list[Outcome] = []
        stop = threading.Event()
        limits = httpx.Limits(max_connections=4 * CLIENTS)
        with httpx.Client(base_url=server.url, timeout=60, limits=limits) as http:
            clients = [threading.Thread(target=load, args=(http, stop, outcomes, w)) for w in range(CLIENTS)]
            for c in clients:
                c.start()
            # The signal lands under steady load: some requests done, most clients with one in the engine.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and (
                len(outcomes) < CLIENTS or httpx.get(f"{server.url}/readyz").json()["pending"] < CLIENTS
            ):
                time.sleep(0.05)
            term_at = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            rc = server.wait(30)
            stop.set()
            for c in clients:
                c.join(30)
    finally:
        server.stop()

    assert rc == 0, server.log()[-3000:]
    # Every request ended: answered (200, or an error with a message) or never admitted.
    assert not [o for o in outcomes if o.kind in ("dropped", "bad answer")], [
        o for o in outcomes if o.kind in ("dropped", "bad answer")
    ]
    assert {o.status for o in outcomes if o.kind == "answer"} <= {200, 503}
    answered = sum(o.kind == "answer" for o in outcomes)
    assert server.log().count('"POST /v1/') == answered, "the server read a request it did not answer"
    unread = [o for o in outcomes if o.kind == "unread"]
    assert all(o.sent > term_at - 0.25 for o in unread), unread
    in_flight = [o for o in outcomes if o.sent < term_at < o.done and o.kind == "answer"]
    assert len(in_flight) >= CLIENTS // 2, "the signal did not land under load"
    # With the default 30 s grace period, what was in flight when the signal came finished.
    assert all(o.status == 200 for o in in_flight), [o for o in in_flight if o.status != 200]
    assert sum(o.status == 200 for o in outcomes) > len(in_flight)

    # Nothing left behind.
    _, alive = psutil.wait_procs(stages, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(shm_prefix)]
    assert not [d for d in ipc_dirs if os.path.exists(d)], "stale ipc directory"
    log = server.log()
    assert "Traceback" not in log, log[-3000:]
