"""Image inputs over HTTP, through the official ``openai`` client against a real server process
(builtin tiny-sd): ``images.edit`` (img2img, inpainting with a mask or the image's transparency),
``images.create_variation``, and chat with an ``image_url`` data URL part. Hostile uploads (not
images, truncated PNGs, decompression bombs, wrong content types, remote URLs) are 400/413/415
naming the field, and the server serves afterwards."""

from __future__ import annotations

import base64
import io
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from .server_process import start_server, stop_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server("--max-num-seqs", "4", log=tmp_path_factory.mktemp("srv") / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def png(array: np.ndarray, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def picture(seed: int, h: int = 64, w: int = 64) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    r, g, b = np.random.default_rng(seed).integers(0, 255, 3)
    disc = ((y - h / 2) ** 2 + (x - w / 3) ** 2) < (min(h, w) / 4) ** 2
    return np.stack([x * r / w, y * g / h, np.where(disc, b, 255 - b)], axis=-1).astype(np.uint8)


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"), dtype=np.int16)


def error_of(excinfo: pytest.ExceptionInfo) -> dict:
    return excinfo.value.response.json()["error"]


def serves(client: openai.OpenAI) -> None:
    """The server still answers a normal edit after whatever came before."""
    resp = client.images.edit(image=("a.png", png(picture(0))), prompt="a fox", extra_body={"seed": 1})
    assert decode(resp.data[0].b64_json).shape == (64, 64, 3)


def test_edit_is_img2img_of_the_upload(client):
    image = png(picture(1))
    first = client.images.edit(
        image=("in.png", image), prompt="a red fox", n=2, extra_body={"seed": 7, "strength": 0.6}
    )
    assert len(first.data) == 2 and [d.model_extra["seed"] for d in first.data] == [7, 8]
    a, b = decode(first.data[0].b64_json), decode(first.data[1].b64_json)
    assert a.shape == (64, 64, 3) and np.abs(a - b).max() > 2
    # Seeds belong to images: image 1 of seed 7 is seed 8's, whatever it was batched with.
    again = client.images.edit(image=("in.png", image), prompt="a red fox", extra_body={"seed": 8, "strength": 0.6})
    assert np.abs(b - decode(again.data[0].b64_json)).max() <= 2
    # The input matters, and so does strength.
    other = client.images.edit(
        image=("in.png", png(picture(2))), prompt="a red fox", extra_body={"seed": 7, "strength": 0.6}
    )
    assert np.abs(a - decode(other.data[0].b64_json)).max() > 2
    strong = client.images.edit(image=("in.png", image), prompt="a red fox", extra_body={"seed": 7, "strength": 1.0})
    assert np.abs(a - decode(strong.data[0].b64_json)).max() > 2


def test_edit_with_a_mask_inpaints_and_size_resizes(client, http, server):
    image = picture(3)
    mask = np.full((64, 64, 4), 255, np.uint8)
    mask[16:48, 16:48, 3] = 0  # transparent: the region to edit (OpenAI's convention)
    resp = client.images.edit(
        image=("in.png", png(image)),
        mask=("mask.png", png(mask, "RGBA")),
        prompt="a cat",
        size="32x32",
        response_format="url",
        extra_body={"seed": 3},
    )
    got = http.get(resp.data[0].url)
    assert got.status_code == 200 and Image.open(io.BytesIO(got.content)).size == (32, 32)
    # An RGBA image without a mask: its own transparent pixels are the mask (inpainting), so the
    # result differs from the same image edited as a whole at the same seed and strength.
    rgba = np.dstack([image, np.full((64, 64), 255, np.uint8)])
    rgba[20:40, 20:40, 3] = 0
    masked = client.images.edit(image=("in.png", png(rgba, "RGBA")), prompt="a cat", extra_body={"seed": 3})
    whole = client.images.edit(image=("in.png", png(image)), prompt="a cat", extra_body={"seed": 3})
    assert np.abs(decode(masked.data[0].b64_json) - decode(whole.data[0].b64_json)).max() > 2


def test_variations(client):
    image = png(picture(4))
    resp = client.images.create_variation(image=("in.png", image), n=2, extra_body={"seed": 11})
    a, b = (decode(d.b64_json) for d in resp.data)
    assert a.shape == (64, 64, 3) and np.abs(a - b).max() > 2
    again = client.images.create_variation(image=("in.png", image), extra_body={"seed": 11})
    assert np.abs(a - decode(again.data[0].b64_json)).max() <= 2
    small = client.images.create_variation(image=("in.png", image), size="48x48")
    assert decode(small.data[0].b64_json).shape == (48, 48, 3)


def test_chat_with_an_input_image(client):
    url = "data:image/png;base64," + base64.b64encode(png(picture(5))).decode()
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "make it blue"}, {"type": "image_url", "image_url": {"url": url}}],
        }
    ]
    resp = client.chat.completions.create(model="tiny-sd", messages=messages, seed=2)
    part = resp.choices[0].message.model_extra["images"][0]
    out = base64.b64decode(part["image_url"]["url"].removeprefix("data:image/png;base64,"))
    with_image = np.asarray(Image.open(io.BytesIO(out)).convert("RGB"), dtype=np.int16)
    text_only = client.chat.completions.create(
        model="tiny-sd", messages=[{"role": "user", "content": "make it blue"}], seed=2
    )
    plain = base64.b64decode(text_only.choices[0].message.model_extra["images"][0]["image_url"]["url"].split(",")[1])
    assert np.abs(with_image - np.asarray(Image.open(io.BytesIO(plain)).convert("RGB"), dtype=np.int16)).max() > 2


def test_chat_refuses_remote_urls_and_bad_data(client):
    for url, text in (
        ("https://example.com/cat.png", "not fetched"),
        ("data:image/png;base64,not base64!", "base64"),
        ("data:image/png;base64," + base64.b64encode(b"hello").decode(), "not an image"),
        ("ftp://x", "not fetched"),
        ("cat.png", "data URL"),
    ):
        messages = [
            {
                "role": "user",
                "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}],
            }
        ]
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny-sd", messages=messages)
        err = error_of(info)
        assert err["param"] == "messages[0].content[1].image_url.url" and text in err["message"], err


def test_bad_uploads_are_400_naming_the_field(client, http):
    cases = [
        ({"image": ("a.png", b"definitely not an image")}, {}, "image", "not an image"),
        ({"image": ("a.png", png(picture(6))[:200])}, {}, "image", "could not be decoded"),
        ({"image": ("a.png", b"")}, {}, "image", "empty"),
        (
            {"image": ("a.png", png(picture(6))), "mask": ("m.png", png(np.zeros((32, 32), np.uint8)))},
            {},
            "mask",
            "size of its image",
        ),
        ({"image": ("a.png", png(picture(6, 36, 64)))}, {}, "image", "multiple of 8"),
        ({"image": ("a.png", png(picture(6)))}, {"strength": "2"}, "strength", ""),
        ({"image": ("a.png", png(picture(6)))}, {"num_inference_steps": "1"}, "strength", "no denoising step"),
        ({"image": ("a.png", png(picture(6)))}, {"size": "12x"}, "size", ""),
        ({"image": ("a.png", png(picture(6)))}, {"n": "0"}, "n", ""),
        ({"image": ("a.png", png(picture(6)))}, {"bogus": "1"}, "bogus", "unknown field"),
        ({"mask": ("m.png", png(picture(6)))}, {}, "image", "exactly one"),
        ({"image": ("a.png", png(picture(6))), "image[]": ("b.png", png(picture(6)))}, {}, "image", "exactly one"),
    ]
    for files, data, param, text in cases:
        r = http.post("/v1/images/edits", files=files, data={"prompt": "x", **data})
        assert r.status_code == 400, (param, r.text)
        err = r.json()["error"]
        assert err["param"] == param and text in err["message"], err
    # A text field where the image file belongs.
    r = http.post("/v1/images/edits", files={"x": ("x", b"")}, data={"prompt": "x", "image": "cat.png"})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("image", "x")
    # The prompt is required for edits, not for variations.
    r = http.post("/v1/images/edits", files={"image": ("a.png", png(picture(6)))})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    serves(client)


def test_decompression_bombs_and_huge_bodies(client, http):
    bomb = io.BytesIO()
    Image.new("L", (5000, 4000)).save(bomb, format="PNG")  # 20 MP of zeros: a few KB compressed
    assert len(bomb.getvalue()) < 100_000
    r = http.post("/v1/images/edits", files={"image": ("bomb.png", bomb.getvalue())}, data={"prompt": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "image" and "limit" in r.json()["error"]["message"]
    big = http.post("/v1/images/variations", files={"image": ("big.png", b"\0" * (9 * 1024 * 1024))})
    assert big.status_code == 413
    serves(client)


def test_wrong_content_types_are_415(http):
    r = http.post("/v1/images/edits", json={"prompt": "x", "image": "abc"})
    assert r.status_code == 415 and "multipart/form-data" in r.json()["error"]["message"]
    r = http.post(
        "/v1/images/variations", content=b"image=abc", headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert r.status_code == 415
    r = http.post("/v1/images/edits", content=b"--broken", headers={"Content-Type": "multipart/form-data; boundary=zz"})
    assert r.status_code == 400


def saved(array: np.ndarray, fmt: str, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    image = Image.fromarray(array)
    (image.convert(mode) if mode else image).save(buf, format=fmt)
    return buf.getvalue()


def corrupt_dds() -> bytes:
    """A DDS header naming a pixel format Pillow's DDS decoder does not implement."""
    header = struct.pack("<7I", 124, 0x1007, 16, 16, 0, 0, 0) + bytes(44) + struct.pack("<2I", 32, 0x4) + b"ZZZZ"
    return b"DDS " + header + bytes(40) + bytes(100)


#: Valid (or nearly valid) files of many formats and modes, as material for mutation.
SEEDS = [
    saved(picture(1, 16, 16), "PNG"),
    saved(picture(1, 16, 16), "PNG", "LA"),
    saved(picture(1, 16, 16), "PNG", "P"),
    saved(picture(1, 16, 16), "JPEG", "CMYK"),
    saved(picture(1, 16, 16), "WEBP"),
    saved(picture(1, 16, 16), "GIF"),
    saved(picture(1, 16, 16), "BMP"),
    saved(picture(1, 16, 16), "TIFF", "LAB"),
    corrupt_dds(),
]


def mutated(seed: bytes, flips: list[tuple[int, int]], cut: int) -> bytes:
    data = bytearray(seed[: max(cut, 8)])
    for at, value in flips:
        data[at % len(data)] = value
    return bytes(data)


BLOBS = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda n, tail: png(picture(1, 16, 16))[:n] + tail, st.integers(0, 400), st.binary(max_size=20)),
    st.builds(
        mutated,
        st.sampled_from(SEEDS),
        st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6),
        st.integers(0, 4000),
    ),
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(
    blob=BLOBS,
    route=st.sampled_from(["/v1/images/edits", "/v1/images/variations"]),
    field=st.sampled_from(["image", "mask"]),
)
def test_hostile_uploads_never_fail_the_server(http, blob, route, field):
    files = {field: ("x.png", blob)}
    if field == "mask":
        files["image"] = ("a.png", png(picture(1, 16, 16)))
    data = {"num_inference_steps": "2", "strength": "1"} | ({"prompt": "x"} if route.endswith("edits") else {})
    r = http.post(route, files=files, data=data)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] in ("image", "mask"), r.text


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(blob=BLOBS)
def test_hostile_data_urls_never_fail_the_server(http, blob):
    r = http.post("/v1/chat/completions", json=chat_body(blob, steps=2))
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "messages[0].content[1].image_url.url", r.text


def chat_body(image: bytes, steps: int | None = None) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "tiny-sd", "messages": [{"role": "user", "content": content}]}


def test_decoder_errors_and_other_formats_are_400_naming_the_field(http):
    dds, lab_tiff = corrupt_dds(), saved(picture(2), "TIFF", "LAB")
    for route, files, param in (
        ("/v1/images/edits", {"image": ("a.dds", dds)}, "image"),
        ("/v1/images/variations", {"image": ("a.dds", dds)}, "image"),
        ("/v1/images/edits", {"image": ("a.png", png(picture(2))), "mask": ("m.tif", lab_tiff)}, "mask"),
    ):
        r = http.post(route, files=files, data={"prompt": "x"} if route.endswith("edits") else {})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "not an image this server can decode" in err["message"], err
    r = http.post("/v1/chat/completions", json=chat_body(dds))
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1].image_url.url", r.text


def test_every_mode_of_the_taken_formats_decodes(http):
    # Palette, grey with alpha, 16-bit grey, CMYK JPEG, WebP, GIF and BMP images; a CMYK mask.
    wide = Image.fromarray(picture(3, 16, 16)[:, :, 0].astype(np.uint16) * 257)
    sixteen = io.BytesIO()
    wide.save(sixteen, format="PNG")
    images = [
        saved(picture(3, 16, 16), "PNG", "P"),
        saved(picture(3, 16, 16), "PNG", "LA"),
        sixteen.getvalue(),
        saved(picture(3, 16, 16), "JPEG", "CMYK"),
        saved(picture(3, 16, 16), "WEBP"),
        saved(picture(3, 16, 16), "GIF"),
        saved(picture(3, 16, 16), "BMP"),
    ]
    for image in images:
        r = http.post(
            "/v1/images/variations", files={"image": ("x", image)}, data={"num_inference_steps": "1", "strength": "1"}
        )
        assert r.status_code == 200, r.text
    mask = saved(np.where(picture(3, 16, 16) > 128, 255, 0).astype(np.uint8), "JPEG", "CMYK")
    r = http.post(
        "/v1/images/edits",
        files={"image": ("a.png", png(picture(3, 16, 16))), "mask": ("m.jpg", mask)},
        data={"prompt": "x", "num_inference_steps": "1", "strength": "1"},
    )
    assert r.status_code == 200, r.text


def test_an_image_over_the_models_limit_is_refused_before_decoding(client, http, server):
    # 4096 x 4096 pixels of black in a 49 KB PNG; tiny-sd takes at most 16 384 pixels per image.
    huge = saved(np.zeros((4096, 4096, 3), np.uint8), "PNG")
    assert len(huge) < 100_000
    proc = psutil.Process(server.pid)
    baseline = proc.memory_info().rss
    peak = [baseline]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            peak[0] = max(peak[0], proc.memory_info().rss)

    def edit(_: int) -> httpx.Response:
        return http.post("/v1/images/edits", files={"image": ("big.png", huge)}, data={"prompt": "x"})

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(edit, range(16)))
        answers.append(http.post("/v1/images/variations", files={"image": ("big.png", huge)}))
        answers.append(http.post("/v1/chat/completions", json=chat_body(huge)))
    finally:
        done.set()
        sampler.join()
    growth = (peak[0] - baseline) / 2**20
    assert growth < 150, f"the server grew by {growth:.0f} MiB refusing 4096x4096 uploads"
    for r in answers:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] in ("image", "messages[0].content[1].image_url.url"), err
        assert "declares 4096x4096 pixels" in err["message"] and "16384" in err["message"], err
    # With a resize, the upload limit bounds the upload and the model's limit the target size.
    r = http.post("/v1/images/edits", files={"image": ("big.png", huge)}, data={"prompt": "x", "size": "512x512"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
    serves(client)


def test_still_serves_after_the_hostile_uploads(client):
    serves(client)
