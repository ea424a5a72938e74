"""The HTTP server against clients that misbehave, and against an engine that dies: bodies over the
limit (with and without Content-Length), slow headers and bodies, values no message can carry,
``n`` that admission could never take, and a dead engine (503, then a non-zero exit)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.reliability.support import http_config

from .server_process import ServerProcess, assert_gone, start_server, stop_server, wait_for, write_config

MAX_BODY = 8 * 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hardening")
    config = write_config(tmp / "hardening.yaml", http_config())
    srv = start_server(
        str(config), "--max-pending", "4", "--header-timeout", "0.5", "--body-timeout", "1", log=tmp / "server.log"
    )
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def assert_error(r: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert error["code"] == code and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_a_body_over_the_limit_is_413_in_the_openai_shape(server, http):
    r = http.post("/v1/chat/completions", content=b"x" * (MAX_BODY + 1), headers={"content-type": "application/json"})
    assert_error(r, 413, "body_too_large")


def test_a_chunked_body_over_the_limit_is_413_too(server, http):
    def chunks():
        for _ in range(MAX_BODY // 65536 + 2):
            yield b" " * 65536

    r = http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "body_too_large")
    assert http.get("/health").status_code == 200


def _raw(server, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.settimeout(10)
    sock.sendall(data)
    return sock


def _read_all(sock: socket.socket) -> bytes:
    got = b""
    while chunk := sock.recv(65536):
        got += chunk
    return got


@pytest.mark.parametrize(
    "partial",
    [b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"],
    ids=["nothing", "half-the-headers"],
)
def test_a_client_that_sends_no_complete_headers_is_cut_off(server, partial):
    start = time.monotonic()
    with _raw(server, partial) as sock:
        answer = _read_all(sock)  # returns once the server closes the connection
    assert 0.4 < time.monotonic() - start < 5
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408")


def test_trickled_headers_do_not_keep_a_connection_open(server):
    """One byte every 0.1 s keeps an idle timer alive forever; the deadline is for the whole."""
    start = time.monotonic()
    with _raw(server, b"P") as sock:
        closed = False
        for byte in b"OST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n":
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            time.sleep(0.1)
        if not closed:
            _read_all(sock)
    assert time.monotonic() - start < 3


def test_a_stalled_body_is_cut_off_and_the_server_keeps_serving(server, http):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    )
    start = time.monotonic()
    with _raw(server, head + b'{"messages": [') as sock:
        _read_all(sock)
    assert 0.9 < time.monotonic() - start < 5
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "still here"}]})
    assert r.status_code == 200


def test_a_model_name_utf8_cannot_encode_is_a_400_not_a_500(server, http):
    body = '{"model": "x\\udfffy", "messages": [{"role": "user", "content": "hi"}]}'
    r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_value", "model")
    r = http.get("/v1/models/x%ED%BF%BFy")  # the same character, as it would reach a path
    assert r.status_code in (400, 404) and r.headers["content-type"].startswith("application/json")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ('{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', None),
        ('{"messages": [{"role": "user", "content": "hi"}], "user": "\\ud83d"}', "user"),
        ('{"prompt": "a\\udfffb"}', "prompt"),
    ],
)
def test_unencodable_text_anywhere_is_a_400_and_the_engine_lives(server, http, body, param):
    route = "/v1/images/generations" if body.startswith('{"prompt"') else "/v1/chat/completions"
    r = http.post(route, content=body, headers={"content-type": "application/json"})
    error = assert_error(r, 400, "invalid_value")
    if param is not None:
        assert error["param"] == param
    assert "UTF-8" in error["message"]
    assert http.post("/v1/images/generations", json={"prompt": "fine"}).status_code == 200


def test_an_out_of_range_integer_in_a_control_call_is_a_400_at_once(server, http):
    start = time.monotonic()
    r = http.post(
        "/v1/omni/collective_rpc",
        json={"method": "set_batching", "kwargs": {"max_num_seqs": 100000000000000000000000}},
    )
    assert time.monotonic() - start < 2
    assert_error(r, 400, "invalid_value", "kwargs.max_num_seqs")
    [ok] = [x for x in http.post("/v1/omni/collective_rpc", json={"method": "ping", "stage_ids": [0]}).json()]
    assert ok["ok"]


def test_more_images_than_admission_can_ever_take_is_a_400_not_a_429(server, http):
    r = http.post("/v1/images/generations", json={"prompt": "many", "n": 5})  # --max-pending 4
    assert_error(r, 400, "invalid_value", "n")
    assert http.post("/v1/images/generations", json={"prompt": "few", "n": 4}).status_code == 200


def test_a_dead_engine_answers_503_then_serve_exits_non_zero(tmp_path):
    """All replicas of a stage gone with no restart left: the request in flight gets its 503, the
    server stops by itself and exits 1 so that a supervisor restarts it."""
    config = http_config(delay_ms=60_000)  # requests to stage 0 wait until killed
    srv = start_server(str(write_config(tmp_path / "dying.yaml", config)), log=tmp_path / "server.log")
    children = srv.children()
    try:
        results: list[httpx.Response] = []
        waiting = threading.Thread(
            target=lambda: results.append(
                httpx.post(f"{srv.url}/v1/images/generations", json={"prompt": "in flight"}, timeout=30)
            )
        )
        waiting.start()
        assert wait_for(lambda: httpx.get(f"{srv.url}/readyz").json()["stages"][0]["inflight"] == 1)
        # The image stage (stage 0) has max_restarts 0: its death is the engine's.
        [ping] = httpx.post(f"{srv.url}/v1/omni/collective_rpc", json={"method": "ping", "stage_ids": [0]}).json()
        victim = ping["result"]["pid"]
        assert victim in {p.pid for p in srv.stage_processes()}
        start = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        waiting.join(10)
        assert results and results[0].status_code == 503
        assert results[0].json()["error"]["code"] == "stage_dead"  # its replica's death, which killed the engine
        assert time.monotonic() - start < 5
        assert srv.wait(15) == 1
        log = srv.log()
        assert "engine died" in log and "no restart left" in log
        assert_gone(children)
    finally:
        if srv.proc.poll() is None:
            srv.stop()


def _load_fail_config(**runner_args: object) -> dict:
    return {
        "model": "slow-load",
        "stage_args": [
            {
                "stage_id": 0,
                "stage_type": "tests.reliability.runners:LoadFailRunner",
                "runtime": {"backend": "process", "torch_threads": 1, "max_restarts": 0},
                "final_output": True,
                "final_output_type": "text",
                "runner_args": runner_args,
            }
        ],
    }


def test_a_loading_engine_answers_503_loading_then_serves(tmp_path):
    """The server listens while the models load: a probe tells 'loading' from 'gone', a request
    gets a 503 with Retry-After, and once loaded the same request succeeds."""
    config = write_config(tmp_path / "slow.yaml", _load_fail_config(fail_replicas=[], load_s=4))
    srv = ServerProcess(str(config), log=tmp_path / "server.log")
    try:
        assert wait_for(lambda: _get_or_none(f"{srv.url}/health") is not None, timeout=60)
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and health.json() == {"status": "loading"}
        assert health.headers["retry-after"] == "1"
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert_error(r, 503, "loading")
        assert r.headers["retry-after"] == "1"
        srv.wait_ready(60)
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    finally:
        assert srv.stop() == 0


def test_an_engine_that_fails_to_load_makes_serve_exit_non_zero(tmp_path):
    config = write_config(tmp_path / "broken.yaml", _load_fail_config())  # every replica fails to load
    srv = ServerProcess(str(config), log=tmp_path / "server.log")
    try:
        assert srv.wait(60) == 1
        assert "failed to start" in srv.log()
        assert_gone(srv.children())
    finally:
        if srv.proc.poll() is None:
            srv.stop()


def _get_or_none(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=1)
    except httpx.HTTPError:
        return None


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"prompt=a+cat", "application/x-www-form-urlencoded"),
        (b'{"prompt": "a cat"}', "text/plain"),
        (b'{"prompt": "a cat"}', None),
    ],
)
def test_a_body_that_is_not_declared_json_is_a_415(server, http, content, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = http.post("/v1/images/generations", content=content, headers=headers)
    error = assert_error(r, 415, "unsupported_media_type")
    assert "application/json" in error["message"]
    ok = http.post(
        "/v1/images/generations",
        content=content if content_type else b'{"prompt": "a cat"}',
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert ok.status_code in (200, 400)  # declared JSON: parsed (form bytes are invalid JSON: a 400)


def test_cors_is_off_by_default(server, http):
    r = http.options(
        "/v1/images/generations",
        headers={"origin": "https://app.example", "access-control-request-method": "POST"},
    )
    assert "access-control-allow-origin" not in r.headers


def test_cors_preflight_is_answered_for_allowed_origins_only(tmp_path):
    config = write_config(tmp_path / "cors.yaml", http_config())
    srv = start_server(
        str(config), "--allowed-origins", "https://app.example", "--api-key", "k", log=tmp_path / "server.log"
    )
    try:
        preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
        ok = httpx.options(f"{srv.url}/v1/images/generations", headers={"origin": "https://app.example", **preflight})
        assert ok.status_code == 200  # before the API-key check: browsers send no key on a preflight
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(
            f"{srv.url}/v1/images/generations", headers={"origin": "https://evil.example", **preflight}
        )
        assert other.headers.get("access-control-allow-origin") != "https://evil.example"
        r = httpx.post(
            f"{srv.url}/v1/images/generations",
            json={"prompt": "a cat"},
            headers={"origin": "https://app.example", "authorization": "Bearer k"},
            timeout=30,
        )
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    finally:
        assert srv.stop() == 0
