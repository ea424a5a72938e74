"""The playground (``/``) and the dashboard (``/dashboard``) in a real headless Chromium (Debian's
``chromium`` and ``chromium-driver``: ``make chromium``), against one real ``omni-runtime serve``
of tiny-sd with an API key: the page asks for the key, a prompt becomes a job whose progress bar
moves and whose image appears, a long job is cancelled, the dashboard shows the wave that ran, a
prompt with markup is shown as text, and every page carries its Content-Security-Policy.

One server and one browser for the module. With ``OMNI_DOCS_SCREENSHOTS=1`` the screenshots are
also written to docs/img/ (the README's pictures)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image
from selenium import webdriver
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from .server_process import REPO, ServerProcess, start_server, stop_server

KEY = "page-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
#: Denoising steps of the job whose progress is watched: long enough for step events mid-way.
STEPS = 24
#: A job that denoises for minutes unless cancelled.
LONG_STEPS = 900
WAIT_S = 90
HOSTILE = '<script>window.__injected = 1</script><img src=x onerror="window.__injected = 2">&amp; "q"'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("pages")
    srv = start_server("tiny-sd", "--api-key", KEY, log=tmp / "server.log")
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    # Both paths are given, so Selenium Manager never looks for (or downloads) a browser or driver.
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
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
    assert _text(browser, "#model option") == "tiny-sd (image)"
    assert _text(browser, "#kind") == "image"
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


def test_the_dashboard_shows_the_wave_that_ran(server: ServerProcess, browser: WebDriver, tmp_path: Path) -> None:
    status = httpx.get(server.url + "/v1/status", headers=AUTH).json()
    (stage,) = status["stages"]
    assert stage["waves"] >= 1 and stage["batch_size_histogram"].get("1", 0) >= 1
    assert status["jobs"]["reached"]["completed"] >= 1 and status["e2e_p50_ms"] > 0
    browser.get(server.url + "/dashboard")  # the key is still in this tab's sessionStorage
    card = '[data-stage="0"]'
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, card), "no stage shown")
    assert int(_text(browser, f"{card} .waves")) >= stage["waves"]
    assert browser.find_elements(By.CSS_SELECTOR, f'{card} .histogram .bar[data-size="1"]')
    assert _text(browser, f"{card} .wave-p50").endswith("ms")
    assert _text(browser, f"{card} .replicas td.state-live") == "live"
    assert _text(browser, "#model") == "tiny-sd" and _text(browser, "#engine") == "ok"
    assert "completed" in _text(browser, "#jobs")
    # It polls: the snapshot's time moves on without a reload.
    shown = _text(browser, "#updated")
    _wait(browser, lambda d: _text(d, "#updated") != shown, "the dashboard did not update", timeout=10)
    _screenshot(browser, tmp_path / "dashboard.png")


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
