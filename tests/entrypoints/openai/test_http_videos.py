"""``/v1/videos`` on a real ``omni-runtime serve`` of tiny-wan (9 frames of 32 x 32, a few steps)
over a private redis-server: create -> poll -> content decoded with PyAV, the thumbnail, the list,
cancel by delete mid-run, bad input as 400s naming the field (JSON or form, hostile values through
hypothesis), ``/v1/generate`` with ``text2video``, the openai client (its ``create`` sends a
multipart form; retrieve, list, delete, download), and a second gateway over the same Redis that
streams, reads, lists and deletes the first one's videos. Image to video: the client's
``input_reference`` upload (or reference object) is the first frame, and ``/v1/generate`` with
``image2video``; hostile uploads are 400s naming the field."""

from __future__ import annotations

import base64
import io
import json
import struct
import time
import zlib
from typing import Any

import av
import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from entrypoints.openai.videos import frames_for

from .jobs_client import read_sse
from .server_process import one_thread_config, start_server, stop_server

pytestmark = pytest.mark.e2e

KEY = "video-test-key"
#: A video that denoises for a long while unless cancelled.
LONG_STEPS = 300
#: A video that runs for many seconds on any machine, to be seen running and cancelled: tiny-wan
#: at its native 32 x 32 makes 300 steps of 9 frames in about half a second with one thread.
LONG = {"num_inference_steps": LONG_STEPS, "size": "256x256", "num_frames": 33}
#: What the servers allow, for LONG (the bundled config allows 4 x the native 32 x 32).
MAX_PIXELS = 256 * 256


@pytest.fixture(scope="module")
def server(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("videos")
    wan = one_thread_config(tmp / "tiny-wan.yaml", "tiny-wan", max_pixels=MAX_PIXELS)
    srv = start_server(wan, "--api-key", KEY, "--redis-url", redis_server.url, log=tmp / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def create(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"prompt": "a boat", "num_frames": 9, "fps": 8, "seed": 1, "num_inference_steps": 2} | fields
    resp = http.post("/v1/videos", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def wait_video(http: httpx.Client, video_id: str, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        video = http.get(f"/v1/videos/{video_id}").json()
        if video["status"] in ("completed", "failed"):
            return video
        time.sleep(0.1)
    raise AssertionError(f"video {video_id} did not end: {video}")


@pytest.fixture(scope="module")
def done(http) -> dict[str, Any]:
    video = create(http, size="32x32")
    assert video["object"] == "video" and video["status"] == "queued" and video["progress"] == 0
    assert video["model"] == "tiny-wan" and video["size"] == "32x32" and video["seconds"] == "1"
    return wait_video(http, video["id"])


def test_create_poll_download_decodes(done, client: openai.OpenAI) -> None:
    assert done["status"] == "completed" and done["progress"] == 100, done
    assert client.videos.retrieve(done["id"]).status == "completed"
    data = client.videos.download_content(done["id"]).content
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        assert stream.average_rate == 8
    assert len(frames) == 9 and frames[0].shape == (32, 32, 3)


def test_thumbnail_is_a_png_of_the_size(done, http: httpx.Client) -> None:
    resp = http.get(f"/v1/videos/{done['id']}/content", params={"variant": "thumbnail"})
    assert resp.status_code == 200 and resp.headers["content-type"] == "image/png"
    assert Image.open(io.BytesIO(resp.content)).size == (32, 32)


def test_list_is_newest_first_with_pagination(done, http: httpx.Client, client: openai.OpenAI) -> None:
    second = wait_video(http, create(http)["id"])
    page = http.get("/v1/videos", params={"limit": 1}).json()
    assert page["object"] == "list" and [v["id"] for v in page["data"]] == [second["id"]] and page["has_more"]
    after = http.get("/v1/videos", params={"limit": 1, "after": second["id"]}).json()
    assert after["data"][0]["id"] == done["id"]
    ids = [v.id for v in client.videos.list()]
    assert ids.index(second["id"]) < ids.index(done["id"])


def test_delete_cancels_a_running_video_and_the_server_serves_on(http: httpx.Client, client: openai.OpenAI) -> None:
    video = create(http, **LONG)
    deadline = time.monotonic() + 60
    while http.get(f"/v1/videos/{video['id']}").json()["status"] != "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    deleted = client.videos.delete(video["id"])
    assert deleted.deleted and deleted.id == video["id"]
    assert http.get(f"/v1/videos/{video['id']}").status_code == 404
    assert video["id"] not in [v["id"] for v in http.get("/v1/videos").json()["data"]]
    assert wait_video(http, create(http)["id"])["status"] == "completed"


def test_seconds_become_frames(http: httpx.Client) -> None:
    video = create(http, num_frames=None, seconds="1")  # 8 fps: 8 frames of motion, 9 in all
    assert video["num_frames"] == 9 and video["seconds"] == "1"
    assert frames_for(4, 16, 4) == 65 and frames_for(0.01, 16, 4) == 5
    resp = http.post("/v1/videos", json={"prompt": "x", "seconds": "2", "fps": 8, "num_frames": 9})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "seconds", resp.text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"num_frames": 8}, "num_frames"),
        ({"size": "33x33"}, "size"),
        ({"size": "big"}, "size"),
        # Past the rotary table's 512 px a side, and past the servers' max_pixels: refused, not a 500.
        ({"size": "1024x32"}, "size"),
        ({"size": "16x4096"}, "size"),
        ({"size": "512x256"}, "size"),
        ({"seconds": "abc"}, "seconds"),
        ({"num_frames": 10**9}, "num_frames"),
        ({"fps": 10**6}, "fps"),
        ({"num_inference_steps": 10**9}, "num_inference_steps"),
        ({"prompt": "a \udcff boat"}, "prompt"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(http: httpx.Client, fields: dict[str, Any], param: str) -> None:
    body = {"prompt": "a boat", "num_frames": 9} | fields
    resp = http.post("/v1/videos", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_unknown_video_is_a_404(http: httpx.Client) -> None:
    assert http.get("/v1/videos/job-xyz").status_code == 404
    assert http.get("/v1/videos/job-xyz/content").status_code == 404


def test_generate_takes_text2video(http: httpx.Client) -> None:
    body = {"task": "text2video", "inputs": {"prompt": "a boat", "num_frames": 5, "num_inference_steps": 2}}
    job = http.post("/v1/generate", json=body | {"async_run": False}).json()
    assert job["status"] == "completed", job
    [video] = job["result"]["videos"]
    resp = http.get(f"/v1/files/{video['file_id']}")
    assert resp.headers["content-type"] == "video/mp4" and video["num_frames"] == 5


#: Every field ``POST /v1/videos`` takes (``input_reference`` aside: a file).
FIELDS = [
    "prompt", "model", "negative_prompt", "num_frames", "fps", "num_inference_steps", "guidance_scale",
    "seconds", "size", "seed", "slo_ms",
]  # fmt: skip
#: Text that no UTF-8 encodes (lone surrogates), next to ordinary text.
UNENCODABLE = st.text(st.characters(codec=None, categories=["Cs", "Lu", "Nd"]), min_size=1, max_size=8)
VALUES = st.one_of(
    st.none(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    UNENCODABLE,
    st.booleans(),
    st.lists(st.integers(0, 9), max_size=2),
    st.dictionaries(st.sampled_from(["a", "width"]), st.integers(0, 9), max_size=1),
)
#: A form's parts are bytes: numbers as text, words, bytes that are no UTF-8, nothing.
FORM_VALUES = st.one_of(
    st.integers(-(2**70), 2**70).map(lambda i: str(i).encode()),
    UNENCODABLE.map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from([b"", b" ", b"1e999", b"nan", b"-inf", b"2.5", b"[1]", b"null", b"true", b"\xff\xfe", b"9" * 400]),
)


def _assert_refused_or_made(http: httpx.Client, resp: httpx.Response, field: str) -> None:
    """A 200 (its video is deleted at once, so later examples do not queue behind it), or a
    400 that names ``field`` with a message; an unknown model is OpenAI's 404. Never a 500."""
    if resp.status_code == 200:
        http.delete(f"/v1/videos/{resp.json()['id']}")
        return
    allowed = (400, 404) if field == "model" else (400,)
    assert resp.status_code in allowed, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and error["message"], resp.text


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(FIELDS), value=VALUES)
def test_any_value_is_a_200_or_a_400(http: httpx.Client, field: str, value: object) -> None:
    body = {"prompt": "x", "num_frames": 5, "num_inference_steps": 1, field: value}
    if field == "seconds":
        body.pop("num_frames")
    resp = http.post("/v1/videos", content=json.dumps(body), headers={"Content-Type": "application/json"})
    _assert_refused_or_made(http, resp, field)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(FIELDS), value=FORM_VALUES)
def test_any_form_value_is_a_200_or_a_400(http: httpx.Client, field: str, value: bytes) -> None:
    data = {"prompt": b"x", "num_frames": b"5", "num_inference_steps": b"1", field: value}
    if field == "seconds":
        data.pop("num_frames")
    resp = http.post("/v1/videos", files={k: (None, v) for k, v in data.items()})
    _assert_refused_or_made(http, resp, field)


def test_the_server_serves_after_the_hypothesis_values(http: httpx.Client) -> None:
    assert wait_video(http, create(http)["id"])["status"] == "completed"


def test_the_openai_clients_create_retrieve_download_delete_and_list(client: openai.OpenAI) -> None:
    """``create`` sends a multipart form, which is taken; ``list`` pages are followed by the client."""
    extra = {"num_frames": 9, "fps": 8, "num_inference_steps": 2}  # sent as form fields too
    video = client.videos.create(model="tiny-wan", prompt="a boat", seconds="1", size="32x32", extra_body=extra)
    assert video.status == "queued" and video.size == "32x32" and video.seconds == "1"
    deadline = time.monotonic() + 120
    while (video := client.videos.retrieve(video.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, video
        time.sleep(0.1)
    assert video.status == "completed", video
    with av.open(io.BytesIO(client.videos.download_content(video.id).content)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]
    assert len(frames) == 9 and frames[0].shape == (32, 32, 3)
    assert [v.id for v in client.videos.list(limit=1).data] == [video.id]  # the newest
    assert client.videos.delete(video.id).deleted
    # Every page, as the client follows them (after = the last id of each page of 5).
    listed = [v.id for v in client.videos.list(limit=5)]
    assert video.id not in listed and len(listed) == len(set(listed))


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"num_frames": "8"}, "num_frames"), ({"fps": "fast"}, "fps"), ({"size": "33x33"}, "size"), ({"x": "1"}, "x")],
)
def test_a_bad_form_field_is_a_400_naming_it(http: httpx.Client, fields: dict[str, str], param: str) -> None:
    data = {"prompt": "a boat", "num_inference_steps": "1"} | fields
    # Each as a part without a filename: a multipart form of text fields, as the openai client sends.
    resp = http.post("/v1/videos", files={k: (None, v) for k, v in data.items()})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def png(rgb: tuple[int, int, int], width: int = 48, height: int = 32) -> bytes:
    image = Image.new("RGB", (width, height), rgb)
    image.paste(tuple(255 - c for c in rgb), (0, 0, width // 3, height // 2))  # type: ignore[arg-type]
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def huge_png() -> bytes:
    """A 1x1 PNG whose header declares 100,000 x 100,000 pixels (the CRC fixed up)."""
    data = bytearray(png((0, 0, 0), 1, 1))
    data[16:24] = struct.pack(">II", 100_000, 100_000)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def first_frames(client: openai.OpenAI, video_id: str) -> list[Any]:
    deadline = time.monotonic() + 120
    while (video := client.videos.retrieve(video_id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, video
        time.sleep(0.1)
    assert video.status == "completed", video
    with av.open(io.BytesIO(client.videos.download_content(video_id).content)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]


def test_the_openai_client_makes_a_video_from_an_input_reference(
    client: openai.OpenAI, http: httpx.Client, tmp_path
) -> None:
    (tmp_path / "red.png").write_bytes(png((255, 0, 0)))
    extra = {"num_frames": 5, "num_inference_steps": 2, "seed": 1}
    with open(tmp_path / "red.png", "rb") as f:  # the client's multipart upload
        red = client.videos.create(model="tiny-wan", prompt="a boat", input_reference=f, extra_body=extra)
    # The same first frame as OpenAI's reference object in JSON (the client uploads files only).
    reference = {"image_url": data_url(png((255, 0, 0)))}
    same = create(http, prompt="a boat", input_reference=reference, num_frames=5, fps=None)
    # An image of another size is resized to `size`, as /v1/images/edits resizes its upload.
    blue_png = ("b.png", png((0, 0, 255), 96, 64), "image/png")
    blue = client.videos.create(
        model="tiny-wan", prompt="a boat", input_reference=blue_png, size="48x32", extra_body=extra
    )
    videos = [first_frames(client, v) for v in (red.id, same["id"], blue.id)]
    assert all(len(v) == 5 and v[0].shape == (32, 48, 3) for v in videos)  # the image's size
    diff = [np.abs(v[0].astype(int) - videos[0][0].astype(int)).mean() for v in videos[1:]]
    assert diff[0] == 0 and diff[1] > 0.1  # the first frame reflects the image


def test_generate_takes_image2video(http: httpx.Client) -> None:
    inputs = {"prompt": "a boat", "num_frames": 5, "num_inference_steps": 2, "image": data_url(png((0, 255, 0)))}
    job = http.post("/v1/generate", json={"task": "image2video", "inputs": inputs, "async_run": False}).json()
    assert job["status"] == "completed", job
    [video] = job["result"]["videos"]
    assert video["num_frames"] == 5 and "image" not in json.dumps(job.get("request", {}))
    assert http.get(f"/v1/videos/{job['job_id']}").json()["status"] == "completed"  # a video like the others
    for task, inputs_ in (("image2video", {"prompt": "x"}), ("text2video", {"prompt": "x", "image": inputs["image"]})):
        resp = http.post("/v1/generate", json={"task": task, "inputs": inputs_})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "inputs.image", resp.text


@pytest.mark.parametrize(
    ("part", "param", "match"),
    [
        ({"files": {"input_reference": ("r.png", b"not an image", "image/png")}}, "input_reference", "not an image"),
        ({"files": {"input_reference": ("r.png", b"", "image/png")}}, "input_reference", "empty"),
        ({"files": {"input_reference": ("r.png", huge_png(), "image/png")}}, "input_reference", "pixel limit"),
        ({"files": {"ref": ("r.png", png((1, 2, 3)), "image/png")}}, "ref", "unknown file field"),
        ({"data": {"input_reference": "abc"}}, "input_reference", "file part"),
        ({"data": {"input_reference[file_id]": "file-1"}}, "input_reference", "file_id"),
        ({"data": {"input_reference[image_url]": "https://x.org/a.png"}}, "input_reference", "remote"),
        ({"data": {"input_reference[image_url]": "data:image/png;base64,@@"}}, "input_reference", "base64"),
        ({"data": {"size": "40x40"}, "files": {"input_reference": ("r.png", png((9, 9, 9)), "image/png")}},
         "input_reference", "`input_reference`: the input image's height 40 is not a multiple of 16"),
        ({"files": {"input_reference": ("r.png", png((9, 9, 9), 4096, 32), "image/png")}},
         "input_reference", f"declares 4096x32 pixels; this model's limit is {MAX_PIXELS} pixels"),
    ],
)  # fmt: skip
def test_a_bad_input_reference_is_a_400_naming_it(http: httpx.Client, part: dict, param: str, match: str) -> None:
    data = {"prompt": "a boat", "num_frames": "5", "num_inference_steps": "1"} | part.get("data", {})
    files = {k: (None, v) for k, v in data.items()} | part.get("files", {})
    resp = http.post("/v1/videos", files=files)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and match in error["message"], error


def test_a_json_input_reference_is_openais_object(http: httpx.Client) -> None:
    for reference in ("data:image/png;base64,AAAA", {"image_url": "data:image/png;base64,AAAA", "x": 1}):
        resp = http.post("/v1/videos", json={"prompt": "a boat", "input_reference": reference})
        assert resp.status_code == 400 and "input_reference" in json.dumps(resp.json()), resp.text


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.one_of(st.binary(max_size=64), st.just(png((1, 2, 3))[:40]), st.just(png((1, 2, 3), 40, 40))))
def test_any_upload_is_a_200_or_a_400(http: httpx.Client, data: bytes) -> None:
    files = {"prompt": (None, "x"), "num_frames": (None, "5"), "input_reference": ("r.png", data, "image/png")}
    resp = http.post("/v1/videos", files=files | {"num_inference_steps": (None, "1")})
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        assert resp.json()["error"]["param"] == "input_reference", resp.text


def test_a_text_body_is_a_415(http: httpx.Client) -> None:
    resp = http.post("/v1/videos", content=b'{"prompt": "a boat"}', headers={"Content-Type": "text/plain"})
    assert resp.status_code == 415 and resp.json()["error"]["code"] == "unsupported_media_type"


# ---------------------------------------------------------------- a second gateway, same Redis


@pytest.fixture(scope="module")
def http_b(server, redis_server, tmp_path_factory):
    """Gateway B: another ``serve`` over the same Redis (jobs and files shared with the first)."""
    tmp = tmp_path_factory.mktemp("videos-b")
    wan = one_thread_config(tmp / "tiny-wan.yaml", "tiny-wan", max_pixels=MAX_PIXELS)
    srv = start_server(wan, "--api-key", KEY, "--redis-url", redis_server.url, log=tmp / "b.log")
    try:
        with httpx.Client(base_url=srv.url, timeout=120, headers={"Authorization": f"Bearer {KEY}"}) as c:
            yield c
    finally:
        stop_server(srv)


def decode(data: bytes) -> tuple[int, tuple[int, ...], float]:
    """Frame count, frame shape and frame rate of an MP4, as PyAV reads them."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(stream)]
        return len(frames), frames[0].shape, float(stream.average_rate or 0)


def test_a_video_made_on_a_is_read_and_downloaded_through_b(http: httpx.Client, http_b) -> None:
    video = create(http, size="32x32", seed=3)
    events = read_sse(http_b, video["id"])  # the job's events, from the other gateway
    assert [e["type"] for e in events][-1] == "completed", events
    seen = http_b.get(f"/v1/videos/{video['id']}").json()
    assert seen == http.get(f"/v1/videos/{video['id']}").json()
    assert seen["status"] == "completed" and seen["progress"] == 100 and seen["size"] == "32x32", seen
    content = http_b.get(f"/v1/videos/{video['id']}/content")
    assert content.headers["content-type"] == "video/mp4"
    assert decode(content.content) == (9, (32, 32, 3), 8.0)
    thumb = http_b.get(f"/v1/videos/{video['id']}/content", params={"variant": "thumbnail"})
    assert Image.open(io.BytesIO(thumb.content)).size == (32, 32)


def test_progress_moves_in_the_events_read_on_b_which_then_cancels_the_video(http: httpx.Client, http_b) -> None:
    video = create(http, **LONG)
    # queued, started, then step events (at most one per 0.3 s: the worker's progress throttle).
    events = read_sse(http_b, video["id"], limit=4)
    steps = [e["data"] for e in events if e["type"] == "step"]
    assert len(steps) == 2 and steps[0]["step"] < steps[1]["step"] < LONG_STEPS == steps[1]["steps"], events
    running = http.get(f"/v1/videos/{video['id']}").json()
    assert running["status"] == "in_progress" and 0 <= running["progress"] < 100, running
    assert http_b.delete(f"/v1/videos/{video['id']}").json()["deleted"]  # A runs it: a signal to A
    assert http.get(f"/v1/videos/{video['id']}").status_code == 404


def test_both_gateways_list_the_stores_videos_and_a_delete_on_b_is_seen_on_a(http: httpx.Client, http_b) -> None:
    on_a = create(http)
    on_b = create(http_b)  # made later: listed first
    for gateway in (http, http_b):
        page = gateway.get("/v1/videos", params={"limit": 2}).json()
        assert [v["id"] for v in page["data"]] == [on_b["id"], on_a["id"]] and page["has_more"], page
        nxt = gateway.get("/v1/videos", params={"limit": 1, "after": on_a["id"]}).json()
        assert nxt["data"] and nxt["data"][0]["created_at"] <= on_a["created_at"]
        oldest_first = gateway.get("/v1/videos", params={"order": "asc", "after": on_a["id"], "limit": 1}).json()
        assert [v["id"] for v in oldest_first["data"]] == [on_b["id"]], oldest_first
    assert wait_video(http, on_b["id"])["status"] == "completed"  # made by B, read on A
    assert wait_video(http, on_a["id"])["status"] == "completed"
    files = [
        v[k]
        for v in http.get(f"/v1/jobs/{on_a['id']}").json()["result"]["videos"]
        for k in ("file_id", "thumbnail_file_id")
    ]
    assert all(http.get(f"/v1/files/{f}").status_code == 200 for f in files)
    deleted = http_b.delete(f"/v1/videos/{on_a['id']}").json()
    assert deleted == {"id": on_a["id"], "object": "video.deleted", "deleted": True}
    for gateway in (http, http_b):
        assert on_a["id"] not in [v["id"] for v in gateway.get("/v1/videos", params={"limit": 100}).json()["data"]]
    # Gone on A as well: the video, its content and poster, its events, its files; a second DELETE.
    paths = [f"/v1/videos/{on_a['id']}", f"/v1/videos/{on_a['id']}/content", f"/v1/jobs/{on_a['id']}/events"]
    paths += [f"/v1/videos/{on_a['id']}/content?variant=thumbnail", *(f"/v1/files/{f}" for f in files)]
    assert [http.get(path).status_code for path in paths] == [404] * len(paths)
    assert http.delete(f"/v1/videos/{on_a['id']}").status_code == 404
    assert http_b.get(f"/v1/videos/{on_b['id']}").json()["status"] == "completed"  # the other video stays
