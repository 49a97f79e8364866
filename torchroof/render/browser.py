"""A headless chromium for the HTML report: its screenshot (examples/html_report.py) and its
browser tests (tests/test_html_browser.py). Debian's ``chromium`` and ``chromium-driver``
packages, driven by selenium (the ``dev`` extra); nothing is downloaded."""

from __future__ import annotations

import shutil
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
INSTALL = "apt-get install chromium chromium-driver"


def find_chromium() -> tuple[str, str] | str:
    """(browser, driver) paths, or a sentence saying what is missing and how to install it."""
    browser = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        missing = " and ".join(
            what for what, path in (("chromium", browser), ("chromedriver", driver)) if not path
        )
        return f"no {missing} on PATH: install Debian's packages ({INSTALL})"
    return browser, driver


def open_chromium(width: int = 1400, height: int = 2200) -> Any:
    """A selenium WebDriver on headless chromium that keeps the page's console log. Raises
    RuntimeError saying what is missing when chromium, its driver or selenium is not
    installed, or when the browser does not start."""
    found = find_chromium()
    if isinstance(found, str):
        raise RuntimeError(found)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError as error:
        raise RuntimeError("selenium is not installed (pip install -e '.[dev]')") from error
    binary, driver = found
    options = Options()
    options.binary_location = binary
    for flag in (
        "--headless=new",
        "--no-sandbox",  # root in a container
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--hide-scrollbars",
        f"--window-size={width},{height}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        return webdriver.Chrome(service=Service(driver), options=options)
    except Exception as error:  # a driver that does not match the browser, no /dev/shm, ...
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RuntimeError(f"chromium did not start: {first}") from error


def console_errors(driver: Any) -> list[str]:
    """The page's console errors since the last call (uncaught exceptions included)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
