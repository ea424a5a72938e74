"""Every route declares its checks: iterating the app's routes, each route under /v1 refuses a
request without the API key (a WebSocket with close code 4401), and each POST route with a body
refuses a wrong content type with a 415. A route added without its dependency fails here.

In process, without the app's lifespan: the checks answer before any engine is needed."""

from __future__ import annotations

import re

import pytest
from fastapi.routing import APIRoute, APIWebSocketRoute
from fastapi.testclient import TestClient
from omni_runtime.entrypoints.openai.body import BodyRoute
from omni_runtime.entrypoints.openai.dependencies import BODY_GUARDS, guards_of
from omni_runtime.entrypoints.openai.server import api_routes, create_app
from starlette.websockets import WebSocketDisconnect

KEY = "route-test-key"
#: POST routes that take no body (a 405 pointing elsewhere).
BODYLESS = {"/v1/jobs"}


@pytest.fixture(scope="module")
def app():
    return create_app("tiny-sd", api_key=KEY)


@pytest.fixture(scope="module")
def client(app):
    return TestClient(app)  # not entered: no lifespan, no engine


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "x", path)


def v1_routes(app):
    routes = [r for r in api_routes(app) if getattr(r, "path", "").startswith("/v1/")]
    assert len(routes) >= 15, [r.path for r in routes]
    return routes


def test_every_v1_route_refuses_a_request_without_the_key(app, client):
    for route in v1_routes(app):
        path = concrete(route.path)
        if isinstance(route, APIWebSocketRoute):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                with client.websocket_connect(path, headers=headers) as ws:
                    assert ws.receive_json()["error"]["code"] == "invalid_api_key"
                    with pytest.raises(WebSocketDisconnect) as closed:
                        ws.receive_json()
                    assert closed.value.code == 4401, route.path
            continue
        assert isinstance(route, APIRoute), route
        for method in route.methods:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = client.request(method, path, json={}, headers=headers)
                assert r.status_code == 401, (method, route.path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert r.headers["WWW-Authenticate"] == "Bearer"


def test_every_post_route_refuses_a_wrong_content_type(app, client):
    posts = [r for r in v1_routes(app) if isinstance(r, APIRoute) and "POST" in r.methods]
    assert {"/v1/images/generations", "/v1/images/edits", "/v1/chat/completions", "/v1/generate"} <= {
        r.path for r in posts
    }
    auth = {"Authorization": f"Bearer {KEY}"}
    for route in posts:
        if route.path in BODYLESS:
            continue
        declared = [g for g in guards_of(route) if g in BODY_GUARDS]
        assert len(declared) == 1, (route.path, declared)  # one declared body content type
        assert isinstance(route, BodyRoute), route.path  # its JSON goes through the one parser
        for content_type in ("text/plain", "application/x-www-form-urlencoded"):
            r = client.post(concrete(route.path), content=b"{}", headers=auth | {"content-type": content_type})
            assert r.status_code == 415, (route.path, content_type, r.text)
            assert r.json()["error"]["code"] == "unsupported_media_type"
        # Sent without a content type, whatever body the route takes: still a 415.
        r = client.post(concrete(route.path), content=b"{}", headers=auth)
        assert r.status_code == 415, route.path


def test_an_unknown_v1_path_needs_the_key_before_it_is_a_404(client):
    assert client.get("/v1/no-such-route").status_code == 401
    assert client.get("/v1/no-such-route", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    assert client.get("/health").status_code == 503  # probes stay open (loading: no lifespan here)


def test_post_v1_videos_shows_its_json_and_form_body_in_the_openapi_schema(app):
    body = app.openapi()["paths"]["/v1/videos"]["post"]["requestBody"]
    assert body["required"] is True
    for content_type in ("application/json", "multipart/form-data"):
        schema = body["content"][content_type]["schema"]
        assert schema["required"] == ["prompt"], content_type
        assert {"prompt", "seconds", "size", "num_frames", "fps", "seed"} <= set(schema["properties"])
