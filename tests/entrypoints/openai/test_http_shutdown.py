"""Graceful shutdown of a real server process: SIGTERM lets an in-flight request finish, aborts it
with a clear 503 after --shutdown-timeout, a second signal exits at once; always exit status 0 and
no stage process left behind."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from .server_process import ServerProcess, assert_gone, flaky_echo_config, wait_for


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three servers, started together to share the start-up time; each test stops one."""
    tmp = tmp_path_factory.mktemp("shutdown")
    config = str(flaky_echo_config(tmp / "slow.yaml", delay_ms=1500))
    procs = {
        "drain": ServerProcess(config, "--shutdown-timeout", "20", log=tmp / "drain.log"),
        "abort": ServerProcess(config, "--shutdown-timeout", "0.5", log=tmp / "abort.log"),
        "force": ServerProcess(config, "--shutdown-timeout", "60", log=tmp / "force.log"),
    }
    try:
        for proc in procs.values():
            proc.wait_ready()
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


class Call(threading.Thread):
    """One chat request in the background; ``response`` or ``error`` when it is done."""

    def __init__(self, url: str, prompt: str) -> None:
        super().__init__()
        self.url, self.prompt = url, prompt
        self.response: httpx.Response | None = None
        self.error: Exception | None = None
        self.start()

    def run(self) -> None:
        body = {"messages": [{"role": "user", "content": self.prompt}]}
        try:
            self.response = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=60)
        except httpx.HTTPError as e:
            self.error = e


def admitted(server: ServerProcess) -> bool:
    return httpx.get(f"{server.url}/readyz").json()["pending"] == 1


def test_sigterm_lets_the_request_finish_and_stops_accepting(servers):
    server = servers["drain"]
    children = server.children()
    call = Call(server.url, "finish me")
    assert wait_for(lambda: admitted(server))
    started = time.monotonic()
    server.signal(signal.SIGTERM)

    def refused() -> bool:
        try:
            httpx.get(f"{server.url}/health", timeout=2)
        except httpx.ConnectError:
            return True
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # Connected into the backlog just before the listener closed: reset, never served.
            return True
        return False

    assert wait_for(refused, timeout=2)  # the listening socket is closed at once
    call.join(30)
    assert call.error is None and call.response is not None
    assert call.response.status_code == 200
    assert call.response.json()["choices"][0]["message"]["content"] == "finish me"
    assert server.wait(30) == 0
    assert time.monotonic() - started < 10
    assert_gone(children)


def test_requests_past_the_grace_period_get_a_clear_503(servers):
    server = servers["abort"]
    children = server.children()
    call = Call(server.url, "hang until the end")
    assert wait_for(lambda: admitted(server))
    started = time.monotonic()
    server.signal(signal.SIGTERM)
    call.join(30)
    assert call.response is not None and call.response.status_code == 503
    error = call.response.json()["error"]
    assert "shut down" in error["message"] and "0.5 s" in error["message"]
    assert server.wait(30) == 0
    assert time.monotonic() - started < 10
    assert_gone(children)


def test_a_second_signal_exits_at_once(servers):
    server = servers["force"]
    children = server.children()
    call = Call(server.url, "hang, nobody waits for me")
    assert wait_for(lambda: admitted(server))
    started = time.monotonic()
    server.signal(signal.SIGTERM)
    time.sleep(0.5)
    assert server.proc.poll() is None  # still draining (grace period 60 s)
    server.signal(signal.SIGINT)
    assert server.wait(20) == 0
    assert time.monotonic() - started < 15
    call.join(10)
    # The client hears about it: an error answer or a closed connection, never a hang.
    assert call.error is not None or call.response.status_code == 503
    assert_gone(children)
