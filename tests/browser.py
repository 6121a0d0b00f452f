"""A real browser for the pages users look at: the distribution's headless Chromium (installed with
apt-get where missing and this is root, as lint does with shellcheck)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def chromium() -> str | None:
    """Chromium's path, installing the distribution's package when it can; None where it cannot."""
    found = shutil.which("chromium")
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"]):
        subprocess.run(cmd, env=env, capture_output=True, timeout=900)
    return shutil.which("chromium")


def _run(browser: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    # root in a container: no sandbox; no GPU; a page's scripts get this much virtual time to draw
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           "--virtual-time-budget=15000", *args], capture_output=True, text=True,
                          timeout=timeout)


def dom(browser: str, url: str) -> str:
    """The page's DOM after its scripts ran."""
    proc = _run(browser, "--dump-dom", url)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def screenshot(browser: str, url: str, png: Path, size: str = "1280,900") -> None:
    proc = _run(browser, f"--screenshot={png}", f"--window-size={size}", url)
    assert proc.returncode == 0 and png.stat().st_size > 0, proc.stderr[-2000:]
