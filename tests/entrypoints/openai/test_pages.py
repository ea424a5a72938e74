"""The playground (``/``) and the dashboard (``/dashboard``) in a real headless Chromium (Debian's
``chromium`` and ``chromium-driver``: ``make chromium``), against one real ``omni-runtime serve``
of five models (tiny-sd, tiny-tts, tiny-wan, the echo model and tiny-omni-voice) with an API key:
the page asks for the key and lists every model with what it can do; a prompt becomes a job whose
progress bar moves and whose image appears; speech, a video and a chat answer each go to their own
route and appear; a long job is cancelled; the realtime tab sends a fake microphone (a WAV file) to
a realtime session, whose turn detection hears the turn, and shows what it heard and the answer's
text and audio;
the dashboard lists every model with its state, draws the selected one's charts from the server's
rolling window and shows the wave that ran; a prompt with markup is shown as text; every page
carries its Content-Security-Policy; and no script error reaches the console.

One server and one browser for the module. With ``OMNI_DOCS_SCREENSHOTS=1`` the screenshots are
also written to docs/img/ (the README's pictures)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
from PIL import Image
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select, WebDriverWait

from .server_process import REPO, ServerProcess, start_server, stop_server, wait_for

KEY = "page-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
#: Denoising steps of the job whose progress is watched: long enough for step events mid-way.
STEPS = 24
#: A job that denoises for minutes unless cancelled.
LONG_STEPS = 900
WAIT_S = 90
HOSTILE = '<script>window.__injected = 1</script><img src=x onerror="window.__injected = 2">&amp; "q"'


#: The served models and what the playground says each makes (its first task's kind).
MODELS = {"tiny-sd": "image", "tiny-tts": "speech", "tiny-wan": "video", "echo": "chat", "tiny-omni-voice": "speech"}
#: The model served lazily: the realtime tab's, loaded by its test.
LAZY = "tiny-omni-voice"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("pages")
    # The realtime model loads on its session's first turn (@lazy), not while the others load.
    served = [f"{name}=tiny-omni-voice@lazy" if name == LAZY else name for name in MODELS]
    srv = start_server(*served, "--api-key", KEY, log=tmp / "server.log")
    try:
        # /health answers once one model serves; the pages are tested with the others loaded.
        def loaded() -> bool:
            models = httpx.get(f"{srv.url}/v1/models", headers=AUTH).json()["data"]
            states = {m["id"]: m["state"] for m in models}
            return states == {name: "unloaded" if name == LAZY else "loaded" for name in MODELS}

        assert wait_for(loaded, timeout=120), srv.log()[-3000:]
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def microphone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the browser's fake microphone plays, once: silence, a spoken-level tone, silence."""
    rate = 16_000
    t = np.arange(int(0.4 * rate)) / rate
    tone = 0.3 * np.sin(2 * np.pi * 220 * t)
    samples = np.concatenate([np.zeros(int(0.2 * rate)), tone, np.zeros(int(1.0 * rate))])
    path = tmp_path_factory.mktemp("microphone") / "turn.wav"
    soundfile.write(path, samples.astype(np.float32), rate, subtype="PCM_16")
    return path


@pytest.fixture(scope="module")
def browser(microphone: Path) -> Iterator[WebDriver]:
    # Both paths are given, so Selenium Manager never looks for (or downloads) a browser or driver.
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, for script errors
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    # A fake microphone that plays the file once, granted without a prompt.
    for arg in ("--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"):
        options.add_argument(arg)
    options.add_argument(f"--use-file-for-fake-audio-capture={microphone}%noloop")
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: WebDriver, predicate, message: str, timeout: float = WAIT_S):  # type: ignore[no-untyped-def]
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: predicate(d), message)


def _text(driver: WebDriver, css: str) -> str:
    return driver.find_element(By.CSS_SELECTOR, css).text


def _screenshot(driver: WebDriver, path: Path) -> None:
    """Save the page, check that it is not blank, and copy it to docs/img/ when asked to."""
    driver.save_screenshot(str(path))
    with Image.open(path) as image:
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 50, f"{path.name} looks blank: {colours and len(colours)} colours"
    if os.environ.get("OMNI_DOCS_SCREENSHOTS") == "1":
        shutil.copy(path, REPO / "docs" / "img" / path.name)


def _submit(driver: WebDriver, prompt: str, steps: int) -> str:
    """Fill the form, submit, and return the new job's id once the page shows it."""
    before = _text(driver, "#job-id")
    prompt_box = driver.find_element(By.ID, "prompt")
    prompt_box.clear()
    prompt_box.send_keys(prompt)
    steps_box = driver.find_element(By.ID, "steps")
    steps_box.clear()
    steps_box.send_keys(str(steps))
    driver.find_element(By.ID, "submit").click()
    _wait(driver, lambda d: _text(d, "#job-id") not in ("", before) or _text(d, "#error"), "nothing submitted")
    assert _text(driver, "#error") == ""
    return _text(driver, "#job-id")


def test_pages_are_public_with_a_content_security_policy(server: ServerProcess) -> None:
    for path, kind in (("/", "text/html"), ("/dashboard", "text/html"), ("/web/app.js", "text/javascript")):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
        csp = r.headers["content-security-policy"]
        assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert r.headers["x-content-type-options"] == "nosniff"
    # No inline script in the pages: every script is a file of this origin.
    for page in ("/", "/dashboard"):
        html = httpx.get(server.url + page).text
        assert html.count("<script") == html.count('<script src="/web/'), page
    assert httpx.get(server.url + "/web/index.html").status_code == 404  # only the listed assets
    assert httpx.get(server.url + "/web/..%2Fpages.py").status_code == 404
    # The data routes need the key, as every /v1 route does.
    assert httpx.get(server.url + "/v1/status").status_code == 401
    assert httpx.get(server.url + "/v1/status/history").status_code == 401


def test_the_playground_asks_for_the_key(server: ServerProcess, browser: WebDriver) -> None:
    browser.get(server.url + "/")
    _wait(browser, lambda d: d.find_element(By.ID, "key-form").is_displayed(), "no key form")
    assert "API key" in _text(browser, "#key-message")
    browser.find_element(By.ID, "key-input").send_keys("a wrong key")
    browser.find_element(By.ID, "key-submit").click()
    _wait(browser, lambda d: "refused" in _text(d, "#key-message"), "a wrong key was not refused")
    browser.find_element(By.ID, "key-input").send_keys(KEY)
    browser.find_element(By.ID, "key-submit").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"), "no model listed")
    assert not browser.find_element(By.ID, "key-form").is_displayed()
    # Every model, with what it makes, and the first one's tasks and capabilities.
    options = [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#model option")]
    assert options == [f"{name} ({kind})" for name, kind in MODELS.items()]
    assert [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#task option")] == ["text2image", "chat"]
    assert _text(browser, "#kind") == "image"
    assert "loaded" in _text(browser, "#caps") and "serves text2image, image_edit" in _text(browser, "#caps")
    # Video parameters are hidden for an image model.
    assert not browser.find_element(By.ID, "frames").is_displayed()


def test_a_prompt_runs_with_a_moving_progress_bar_and_its_image_appears(
    server: ServerProcess, browser: WebDriver, tmp_path: Path
) -> None:
    job_id = _submit(browser, "a lighthouse at dusk", STEPS)
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#result img"), "no image", timeout=120)
    assert _text(browser, "#status") == "completed"
    # The bar moved through the job's step events, from part-way to full.
    trail = browser.execute_script("return document.getElementById('progress').dataset.seen")
    seen = [tuple(map(int, s.split("/"))) for s in trail.split(",")]
    assert any(0 < step < steps for step, steps in seen), seen
    assert seen[-1] == (STEPS, STEPS)
    progress = browser.find_element(By.ID, "progress")
    assert progress.get_property("value") == progress.get_property("max") == STEPS
    image = browser.find_element(By.CSS_SELECTOR, "#result img")
    assert image.get_attribute("src").startswith("blob:")
    assert browser.execute_script("return arguments[0].complete && arguments[0].naturalWidth", image) == 64
    # Its history entry, and the key never in a URL the page fetched.
    entry = browser.find_element(By.CSS_SELECTOR, f'#history li[data-job="{job_id}"]')
    assert "a lighthouse at dusk" in entry.text and "completed" in entry.text
    urls = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and not any(KEY in u for u in urls)
    assert KEY not in server.log()
    _screenshot(browser, tmp_path / "playground.png")


def test_a_prompt_with_markup_is_shown_as_text(server: ServerProcess, browser: WebDriver) -> None:
    browser.get(server.url + "/")
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"), "no model listed")
    job_id = _submit(browser, HOSTILE, 1)
    _wait(browser, lambda d: _text(d, "#status") == "completed", "the job did not complete")
    entry = browser.find_element(By.CSS_SELECTOR, f'#history li[data-job="{job_id}"] .prompt')
    assert entry.text == HOSTILE
    assert not browser.find_elements(By.CSS_SELECTOR, "#history script, #history li img")
    assert browser.execute_script("return window.__injected") is None
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text  # noqa: B018 - reading it is what raises


def test_a_long_job_is_cancelled(server: ServerProcess, browser: WebDriver) -> None:
    job_id = _submit(browser, "a job that is cancelled", LONG_STEPS)
    _wait(browser, lambda d: d.find_element(By.ID, "progress").get_property("value") > 0, "no progress")
    browser.find_element(By.ID, "cancel").click()
    _wait(browser, lambda d: _text(d, "#status") == "cancelled", "the job was not cancelled")
    assert not browser.find_elements(By.CSS_SELECTOR, "#result img")
    assert browser.find_element(By.ID, "submit").is_enabled()
    entry = browser.find_element(By.CSS_SELECTOR, f'#history li[data-job="{job_id}"]')
    assert "cancelled" in entry.text
    job = httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=AUTH).json()
    assert job["status"] == "cancelled"
    assert job["progress"]["step"] < LONG_STEPS


def _choose(driver: WebDriver, model: str, task: str) -> None:
    Select(driver.find_element(By.ID, "model")).select_by_value(model)
    Select(driver.find_element(By.ID, "task")).select_by_value(task)


def _posted(driver: WebDriver) -> list[str]:
    """The paths of the API calls the page made."""
    entries = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    return [e.split("//", 1)[-1].split("/", 1)[-1] for e in entries]


def test_each_kind_goes_to_its_route_and_its_result_appears(server: ServerProcess, browser: WebDriver) -> None:
    browser.get(server.url + "/")
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"), "no model listed")
    prompt = browser.find_element(By.ID, "prompt")
    # Speech: POST /v1/audio/speech, the clip played from a blob.
    _choose(browser, "tiny-tts", "text2speech")
    assert _text(browser, "#kind") == "speech" and browser.find_element(By.ID, "voice").is_displayed()
    assert not browser.find_element(By.ID, "steps").is_displayed()
    prompt.clear()
    prompt.send_keys("hello there")
    browser.find_element(By.ID, "submit").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#result audio") or _text(d, "#error"), "no speech")
    assert _text(browser, "#error") == "" and _text(browser, "#status") == "completed"
    assert browser.find_element(By.CSS_SELECTOR, "#result audio").get_attribute("src").startswith("blob:")
    # A video: POST /v1/videos, followed as its job, the MP4 fetched with the key.
    _choose(browser, "tiny-wan", "text2video")
    assert browser.find_element(By.ID, "frames").is_displayed()
    prompt.clear()
    prompt.send_keys("a boat")
    for field, value in (("steps", 2), ("frames", 5)):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(str(value))
    browser.find_element(By.ID, "submit").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#result video") or _text(d, "#error"), "no video")
    assert _text(browser, "#error") == "" and _text(browser, "#status") == "completed"
    video_id = _text(browser, "#job-id")
    video = httpx.get(f"{server.url}/v1/videos/{video_id}", headers=AUTH).json()
    assert video["status"] == "completed" and video["model"] == "tiny-wan" and video["num_frames"] == 5
    # A chat answer: POST /v1/chat/completions, the text shown as text.
    _choose(browser, "echo", "chat")
    assert not browser.find_element(By.ID, "seed").is_displayed()
    prompt.clear()
    prompt.send_keys("<b>echo</b> me")
    browser.find_element(By.ID, "submit").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#result .answer") or _text(d, "#error"), "no answer")
    assert _text(browser, "#error") == "" and "<b>echo</b> me" in _text(browser, "#result .answer")
    paths = _posted(browser)
    assert {"v1/audio/speech", "v1/videos", "v1/chat/completions"} <= set(paths), paths
    assert "v1/generate" not in paths  # no job for these kinds here


def test_the_realtime_tab_hears_the_microphone_and_answers_with_text_and_audio(
    server: ServerProcess, browser: WebDriver
) -> None:
    browser.get(server.url + "/")  # the key is still in this tab's sessionStorage
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#rt-model option"), "no realtime model")
    # Only a model whose first stage hears audio is offered.
    assert [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#rt-model option")] == ["tiny-omni-voice"]
    browser.find_element(By.ID, "rt-start").click()
    answered = "#rt-turns li[data-status]"
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, answered) or _text(d, "#rt-error"), "no answer")
    assert _text(browser, "#rt-error") == ""
    turn = browser.find_element(By.CSS_SELECTOR, answered)
    assert turn.get_attribute("data-status") == "completed" and turn.get_attribute("data-item")
    # What the model heard of the turn, shown once its transcript is complete.
    assert turn.get_attribute("data-heard") == "completed"
    assert turn.find_element(By.CSS_SELECTOR, ".heard").text.startswith("you said: ")
    assert turn.find_element(By.CSS_SELECTOR, ".answer").text  # the transcript of the answer
    assert turn.find_element(By.CSS_SELECTOR, "audio").get_attribute("src").startswith("blob:")
    browser.find_element(By.ID, "rt-stop").click()
    _wait(browser, lambda d: not d.find_element(By.ID, "rt-start").get_property("disabled"), "not stopped")
    # The key went as a subprotocol: never in a URL the page opened, nor in the server's log.
    urls = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert not any(KEY in u for u in urls) and KEY not in server.log()
    assert httpx.get(server.url + "/health").status_code == 200


def test_the_dashboard_lists_every_model_and_charts_the_selected_one(
    server: ServerProcess, browser: WebDriver, tmp_path: Path
) -> None:
    status = httpx.get(server.url + "/v1/status", params={"model": "tiny-sd"}, headers=AUTH).json()
    (stage,) = status["stages"]
    assert stage["waves"] >= 1 and stage["batch_size_histogram"].get("1", 0) >= 1
    assert status["jobs"]["reached"]["completed"] >= 1 and status["e2e_p50_ms"] > 0

    # The server's window: every model, one sample every period, with a latency point once the
    # sample after its requests is taken.
    def window() -> list[dict]:
        return httpx.get(server.url + "/v1/status/history", headers=AUTH).json()["models"]

    assert wait_for(lambda: all(any(s["e2e_p50_ms"] for s in w["samples"]) for w in window()), timeout=10)
    models = window()
    assert [w["model"] for w in models] == list(MODELS)
    for w in models:
        assert w["period_s"] == 2.0 and w["span_s"] == 600.0 and w["samples"][-1]["state"] == "loaded"
    # One model's, and only the samples after a time.
    history = server.url + "/v1/status/history"
    one = httpx.get(history, params={"model": "echo"}, headers=AUTH).json()
    assert one["model"] == "echo" and one["samples"]
    last = one["samples"][-1]["time"]
    later = httpx.get(history, params={"model": "echo", "since": last}, headers=AUTH).json()["samples"]
    assert all(s["time"] > last for s in later)
    assert httpx.get(history, params={"model": "nope"}, headers=AUTH).status_code == 404
    browser.get(server.url + "/dashboard#tiny-sd")  # the key is still in this tab's sessionStorage
    _wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#models tbody tr")) == len(MODELS), "no models")
    for name in MODELS:
        assert _text(browser, f'#models tr[data-model="{name}"] .badge') == "loaded"
    # The selected model: its stage now, as before...
    card = '[data-stage="0"]'
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, card), "no stage shown")
    assert int(_text(browser, f"{card} .waves")) >= stage["waves"]
    assert browser.find_elements(By.CSS_SELECTOR, f'{card} .histogram .bar[data-size="1"]')
    assert _text(browser, f"{card} .wave-p50").endswith("ms")
    assert _text(browser, f"{card} .replicas td.state-live") == "live"
    assert _text(browser, "#model") == "tiny-sd" and _text(browser, "#engine") == "ok"
    assert "completed" in _text(browser, "#jobs")
    # ...and its charts over the last minutes: the requests that ran are points on them.
    charts = [c.get_attribute("data-chart") for c in browser.find_elements(By.CSS_SELECTOR, "#charts figure")]
    assert charts == ["requests", "latency", "queue", "batch", "waves", "cache", "restarts", "memory"]
    for chart in ("requests", "latency", "waves", "batch", "queue"):
        points = browser.find_element(By.CSS_SELECTOR, f'[data-chart="{chart}"]').get_attribute("data-points")
        assert int(points) > 0, chart
    assert browser.find_elements(By.CSS_SELECTOR, '[data-chart="latency"] .series :is(polyline, circle)')
    assert browser.find_elements(By.CSS_SELECTOR, '[data-chart="queue"] g[data-series="stage 0 · replica 0"]')
    # Each model can be selected: its name, its charts and its stage.
    for name in reversed(MODELS):
        browser.find_element(By.CSS_SELECTOR, f'#models button[data-model="{name}"]').click()
        _wait(browser, lambda d, name=name: _text(d, "#model") == name, f"{name} not selected")
        assert browser.find_element(By.ID, "charts").get_attribute("data-model") == name
        assert browser.find_elements(By.CSS_SELECTOR, f'#models tr.selected[data-model="{name}"]')
        latency = browser.find_element(By.CSS_SELECTOR, '[data-chart="latency"]').get_attribute("data-points")
        assert int(latency) > 0, name
    assert _text(browser, f"{card} h2") == "Stage 0 · diffusion"  # tiny-sd, last selected
    # It polls: the snapshot's time moves on without a reload.
    shown = _text(browser, "#updated")
    _wait(browser, lambda d: _text(d, "#updated") != shown, "the dashboard did not update", timeout=10)
    _screenshot(browser, tmp_path / "dashboard.png")


def test_no_script_error_reached_the_console(browser: WebDriver) -> None:
    # Failed loads (the 401s that ask for the key) are network entries; a script error is not.
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and e.get("source") != "network"]
    assert not errors, errors
