"""The dashboard in a real headless browser (issue 13, item 4): Debian's chromium driven by selenium.

The Makefile's ``browser`` set-up installs chromium and chromium-driver (apt-get, idempotent).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from streamrover.testing.procs import MasterProcess
from tests.brokers.tansu import TansuBroker
from tests.helpers import wait_until
from tests.shard_service.dashboard_job import start_stream_job

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# What this machine's closed network needs (ENVIRONMENT.md: without the background-networking flags
# chromium's connections are refused many at a time).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1600"]  # fmt: skip


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM  # with the driver's path given, selenium-manager downloads nothing
        for flag in [*FLAGS, f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
        try:
            yield driver
        finally:
            driver.quit()


def _attr(driver: Any, css: str, name: str = "data-value") -> str | None:
    """The attribute of the element ``css`` selects now, read in one script call: the live page re-renders its
    tables, so an element found first and read after can be gone (StaleElementReferenceException, seen)."""
    script = "const e = document.querySelector(arguments[0]); return e ? e.getAttribute(arguments[1]) : null;"
    value = driver.execute_script(script, css, name)
    return None if value is None else str(value)


def _visible(driver: Any, element_id: str) -> bool:
    from selenium.webdriver.common.by import By

    return bool(driver.find_element(By.ID, element_id).is_displayed())


def test_the_page_shows_the_live_lag_and_auc_of_a_running_job(
    browser: Any, tansu_broker: TansuBroker, master: MasterProcess
) -> None:
    job = start_stream_job(tansu_broker, master, (40, 20))
    job.commit()
    job.worker.report({"auc": 0.8125, "loss": 0.4375}, step=7)
    browser.get(master.dashboard_url + "#token=" + master.token)
    auc = '[data-reporter="rank0@test"][data-metric="auc"]'
    wait_until(lambda: _attr(browser, auc) == "0.8125", 30, "the page to show the reported AUC")
    assert "token" not in browser.current_url, "the token must leave the address bar (and so the history)"
    assert not _visible(browser, "login")
    lag = f'[data-lag-partition="{job.topic}-0"]'
    assert _attr(browser, lag) == "0" and _attr(browser, "#lag-total") == "0"
    assert _attr(browser, "#workers") == "1"

    job.produce((9, 4))  # live: the page follows the broker and the trainer without a reload
    job.worker.report({"auc": 0.875}, step=8)
    wait_until(lambda: _attr(browser, lag) == "9", 30, "the page to show partition 0's new lag")
    wait_until(lambda: _attr(browser, "#lag-total") == "13", 30, "the page to show the total lag")
    wait_until(lambda: _attr(browser, auc) == "0.875", 30, "the page to show the new AUC")
    charts = browser.execute_script(
        "return [...document.querySelectorAll('.chart')].map(c => [c.dataset.chart,"
        " c.querySelectorAll('polyline').length])"
    )
    assert ["auc", 1] in charts and ["lag per partition (records)", 2] in charts, charts
    points = browser.execute_script(
        "return document.querySelector('[data-chart=auc] polyline').getAttribute('points').split(' ').length"
    )
    assert points == 2, "the AUC chart draws both reports"
    job.worker.close()


def test_the_page_refuses_without_the_token(browser: Any, master: MasterProcess) -> None:
    from selenium.webdriver.common.by import By

    browser.get(master.dashboard_url)
    wait_until(lambda: _visible(browser, "login"), 30, "the page to ask for the token")
    assert not _visible(browser, "job") and "needs the job token" in browser.find_element(By.ID, "state").text
    assert _attr(browser, "#lag-total") is None, "no data without the token"

    browser.get(master.dashboard_url + "#token=wrong")  # a wrong token: refused by the master (401)
    browser.refresh()
    wait_until(lambda: "refused" in browser.find_element(By.ID, "state").text, 30, "the page to say it was refused")
    assert not _visible(browser, "job")

    field = browser.find_element(By.ID, "token-input")  # the login form: the right token shows the job
    field.send_keys(master.token)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    wait_until(lambda: _visible(browser, "job"), 30, "the page to show the job after the login form")
    assert _attr(browser, "#workers") == "0"
