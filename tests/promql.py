"""Prometheus' HTTP API as the tests ask it: an instant query, waited for (scrapes come every few
seconds)."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request


def wait_for_query(url: str, query: str, done, timeout: float = 90) -> list[dict]:
    """Prometheus' answer to an instant query at `url`, once `done(result)` holds."""
    deadline, result = time.time() + timeout, None
    while time.time() < deadline:
        with urllib.request.urlopen(f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": query}),
                                    timeout=10) as r:
            result = json.loads(r.read())["data"]["result"]
        if done(result):
            return result
        time.sleep(2)
    raise AssertionError(f"Prometheus at {url}: {query} gave {result} after {timeout} s")
