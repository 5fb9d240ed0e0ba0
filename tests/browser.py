"""Headless Debian Chromium driven by Playwright (its driver only: no browser download), for the UI test."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium")
# without the background-networking flags Chromium keeps calling Google's hosts, which this network refuses
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 60_000


def why_not() -> str | None:
    """Why the browser test cannot run here, or None."""
    if CHROMIUM is None:
        return "Debian's chromium is not installed (`make test` installs it where apt-get runs as root)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (it is in the dev extra: pip install -e '.[dev]')"
    return None


@contextlib.contextmanager
def page(shots: Path):
    """A fresh browser page; `shot(name)` saves a full-page screenshot as `shots/name.png`."""
    from playwright.sync_api import sync_playwright

    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1000})
            pg.set_default_timeout(WAIT_MS)
            yield pg
        finally:
            browser.close()


def shot(pg, shots: Path, name: str) -> Path:
    path = shots / f"{name}.png"
    pg.screenshot(path=str(path), full_page=True)
    return path


def see(pg, text: str, exact: bool = True):
    """Wait until `text` is visible on the page (the UI renders after its API calls return)."""
    found = pg.get_by_text(text, exact=exact).first
    found.wait_for(state="visible")
    return found
