"""A real browser for the pages users look at: the distribution's headless Chromium (installed with
apt-get where missing and this is root, as lint does with shellcheck)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess


def chromium() -> str | None:
    """Chromium's path, installing the distribution's package when it can; None where it cannot."""
    found = shutil.which("chromium")
    if found or os.geteuid() != 0 or not shutil.which("apt-get"):
        return found
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # one apt-get at a time: the cluster and emulated tiers run side by side and both may install it
    lock = ["flock", "-w", "900", "/var/lock/dlcluster-apt.lock"]
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"]):
        subprocess.run([*lock, *cmd], env=env, capture_output=True, timeout=1800)
    return shutil.which("chromium")


# the flags the distribution's Chromium needs on these machines: root in a container, no GPU, and
# nothing it would reach for on its own (updates, sync, components) on a closed network
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextlib.contextmanager
def signed_in(browser: str, user: str, password: str, size: tuple[int, int] = (1280, 760)):
    """A page of a real browser (Playwright driving the distribution's Chromium) that signs in
    with HTTP basic auth, as a user at the sign-in prompt does; closed afterwards."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chrome = p.chromium.launch(executable_path=browser, args=LAUNCH_ARGS)
        try:
            context = chrome.new_context(http_credentials={"username": user, "password": password},
                                         viewport={"width": size[0], "height": size[1]})
            yield context.new_page()
        finally:
            chrome.close()


# the points a chart card of MLflow's run page draws (plotly: one path.point per step). The card is
# the widest element around the title that holds no other chart's title: a card whose chart is not
# drawn yet counts 0 (walking up to the first element with a chart in it once counted three
# charts' points, 9 for 3, when the loss card had not drawn yet)
_CHART_POINTS = """title => {
  let card = document.querySelector(`h4[title="${title}"]`);
  while (card && card.parentElement && card.parentElement.querySelectorAll('h4[title]').length === 1)
    card = card.parentElement;
  return card ? card.querySelectorAll('g.points path.point').length : 0;
}"""


def mlflow_chart_points(page, metric: str, at_least: int) -> int:
    """On an MLflow run's metric charts (its page's /model-metrics): the points `metric`'s chart
    draws, once it draws `at_least` (what it drew after 90 s otherwise: none, for a chart without)."""
    try:
        page.wait_for_function(f"t => ({_CHART_POINTS})(t) >= {at_least}", arg=metric, timeout=90_000)
    except Exception:  # noqa: BLE001  (the count says what it drew)
        pass
    return page.evaluate(_CHART_POINTS, metric)
