"""Headless Chromium for the interactive views' tests: Debian's `chromium` (scripts/setup.sh installs it)
driven by Playwright's Python package, with no network, no GPU and no first-run work."""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]


@contextmanager
def page_of(path: Path) -> Iterator[tuple]:
    """(page, requests): `path` opened in a fresh headless Chromium, and every URL the page asked for."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page()
            requests: list[str] = []
            page.on("request", lambda request: requests.append(request.url))
            page.goto(path.resolve().as_uri())
            yield page, requests
        finally:
            browser.close()
