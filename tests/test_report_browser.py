"""The cost instrument in a real headless Chromium (Debian's chromium + chromium-driver, via selenium).

Skipped only when no Chromium/chromedriver is installed; CI installs them with
`apt-get update && apt-get install -y chromium chromium-driver` (selenium comes from the test extra).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import pytest

from tilewise.report import build_report

CHROMIUM = os.environ.get("TILEWISE_CHROMIUM") or next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
CHROMEDRIVER = os.environ.get("TILEWISE_CHROMEDRIVER") or shutil.which("chromedriver")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1280,1400")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason=f"needs Chromium and chromedriver (found chromium={CHROMIUM}, chromedriver={CHROMEDRIVER}); "
           "install with: apt-get install -y chromium chromium-driver")


@pytest.fixture(scope="module")
def driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="tilewise-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        opts.add_argument(flag)
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    yield d
    d.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    bare = tmp_path_factory.mktemp("bare")
    measured = tmp_path_factory.mktemp("measured")
    points = [{"tokens": t, "seconds": 1e-5 * t} for t in (64, 256, 1024)]
    (measured / "costs.json").write_text(json.dumps(points))
    return {"bare": build_report(bare).as_uri(), "measured": build_report(measured).as_uri()}


def by_id(d, eid):
    from selenium.webdriver.common.by import By

    return d.find_element(By.ID, eid)


def text(d, eid) -> str:
    return by_id(d, eid).text.strip()


def value(d, eid) -> str:
    return by_id(d, eid).get_attribute("value")


def type_into(d, eid, s: str) -> None:
    """Replace a field's content by keystrokes (select all, delete, type), firing input events like a user."""
    from selenium.webdriver.common.keys import Keys

    el = by_id(d, eid)
    el.send_keys(Keys.CONTROL, "a")
    el.send_keys(Keys.BACKSPACE)
    if s:
        el.send_keys(s)


def open_page(d, url):
    d.get(url)
    assert d.execute_script("return document.readyState") == "complete"


def wait_until(d, fn, timeout=10.0):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(d, timeout, poll_frequency=0.05).until(lambda _: fn())


def test_initial_state_shows_y_1_and_increment(driver, pages):
    open_page(driver, pages["bare"])
    assert (value(driver, "ci-a"), value(driver, "ci-x"), text(driver, "ci-y")) == ("1", "1", "1")
    assert text(driver, "ci-increment") == "0.1"
    assert "no measurement in this run" in text(driver, "ci-no-measurement")
    assert "cannot decide" in text(driver, "ci-caveat")


def test_a1_x1_predict_1_is_right(driver, pages):
    open_page(driver, pages["bare"])
    by_id(driver, "ci-reset").click()
    type_into(driver, "ci-a", "1")
    type_into(driver, "ci-x", "1")
    type_into(driver, "ci-predict", "1")
    assert text(driver, "ci-y") == "1"
    assert text(driver, "ci-verdict").startswith("right")


def test_a1_x1_5_gives_2_25_and_judges_predictions(driver, pages):
    open_page(driver, pages["bare"])
    by_id(driver, "ci-reset").click()
    type_into(driver, "ci-a", "1")
    type_into(driver, "ci-x", "1.5")
    assert text(driver, "ci-y") == "2.25"
    type_into(driver, "ci-predict", "2")
    assert text(driver, "ci-verdict") == "off by +0.25 (you predicted 2, y = 2.25)"
    type_into(driver, "ci-predict", "2.25")
    assert text(driver, "ci-verdict").startswith("right")
    assert "x \u00d71.5 gives y \u00d72.25" in text(driver, "ci-ratio")
    type_into(driver, "ci-a", "2")
    type_into(driver, "ci-x", "3")
    assert text(driver, "ci-y") == "18"
    type_into(driver, "ci-x", "")
    assert text(driver, "ci-y") == "\u2014"


def test_step_advances_by_the_increment_and_reset_restores(driver, pages):
    open_page(driver, pages["bare"])
    type_into(driver, "ci-x", "1.5")
    type_into(driver, "ci-predict", "2.25")
    by_id(driver, "ci-step").click()
    assert (value(driver, "ci-x"), text(driver, "ci-y")) == ("1.6", "2.56")
    by_id(driver, "ci-step").click()
    assert (value(driver, "ci-x"), text(driver, "ci-y")) == ("1.7", "2.89")  # 1.7^2, no float noise
    assert text(driver, "ci-verdict") == "off by +0.64 (you predicted 2.25, y = 2.89)"
    assert text(driver, "ci-trace").splitlines() == ["x = 1.6, y = 2.56", "x = 1.7, y = 2.89"]
    type_into(driver, "ci-a", "3")
    by_id(driver, "ci-reset").click()
    assert (value(driver, "ci-a"), value(driver, "ci-x"), value(driver, "ci-predict")) == ("1", "1", "")
    assert text(driver, "ci-y") == "1" and text(driver, "ci-trace") == ""


def test_play_animates_steps_to_the_limit_and_pause_stops(driver, pages):
    open_page(driver, pages["bare"])
    type_into(driver, "ci-x", "2.6")
    by_id(driver, "ci-play").click()
    assert text(driver, "ci-play") == "Pause"
    wait_until(driver, lambda: value(driver, "ci-x") == "2.8")  # animated: intermediate states are shown
    wait_until(driver, lambda: "stopped at the limit" in text(driver, "ci-status"))
    assert (value(driver, "ci-x"), text(driver, "ci-y"), text(driver, "ci-play")) == ("3", "9", "Play")
    assert len(text(driver, "ci-trace").splitlines()) == 4
    by_id(driver, "ci-reset").click()
    by_id(driver, "ci-play").click()
    wait_until(driver, lambda: value(driver, "ci-x") != "1")
    by_id(driver, "ci-play").click()  # Pause
    assert text(driver, "ci-play") == "Play"
    paused_at = value(driver, "ci-x")
    driver.execute_script("return new Promise(r => setTimeout(r, 1000))")
    assert value(driver, "ci-x") == paused_at
    by_id(driver, "ci-reset").click()
    assert (value(driver, "ci-x"), text(driver, "ci-y")) == ("1", "1")


def test_measured_curve_sits_beside_the_instrument(driver, pages):
    from selenium.webdriver.common.by import By

    open_page(driver, pages["measured"])
    section = by_id(driver, "cost-instrument")
    plot = section.find_element(By.CSS_SELECTOR, "#measured-cost svg")
    assert len(plot.find_elements(By.CSS_SELECTOR, "circle")) == 3
    assert not section.find_elements(By.ID, "ci-no-measurement")
    left = by_id(driver, "ci-y").location["x"]
    assert plot.location["x"] > left  # beside, to the right at this window width
