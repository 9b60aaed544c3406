"""A tiny HTTP client that acts as a logged-in admin (login, CSRF, forms); used by swarm_up and tests."""

from __future__ import annotations

import http.cookiejar
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from agent.procs import wait_until


class AdminClient:
    """Logs in through the real login form and posts forms with the CSRF token, as a browser would."""

    def __init__(self, base_url: str, timeout_s: float = 30.0) -> None:
        self.base = base_url.rstrip("/")
        self.jar = http.cookiejar.CookieJar()
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(self.jar))
        self.timeout = timeout_s

    def cookie(self, name: str) -> str:
        return next((c.value or "" for c in self.jar if c.name == name), "")

    def get(self, path: str) -> tuple[int, str]:
        try:
            with self.opener.open(self.base + path, timeout=self.timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def post(self, path: str, data: dict[str, str]) -> tuple[int, str]:
        req = urllib.request.Request(
            self.base + path,
            data=urllib.parse.urlencode(data).encode(),
            method="POST",
            headers={
                "X-CSRFToken": self.cookie("csrftoken"),
                "Referer": self.base + "/",
                "HX-Request": "true",
            },
        )
        try:
            with self.opener.open(req, timeout=self.timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def login(self, username: str, password: str) -> None:
        self.get("/accounts/login/")
        status, body = self.post(
            "/accounts/login/",
            {"username": username, "password": password, "csrfmiddlewaretoken": self.cookie("csrftoken")},
        )
        if not self.cookie("sessionid"):
            raise RuntimeError(f"login as {username} failed (HTTP {status})")

    def status(self) -> dict[str, Any]:
        code, body = self.get("/fleet/status.json")
        if code != 200:
            raise RuntimeError(f"/fleet/status.json answered {code}")
        return json.loads(body)

    def create_enrollment_token(self, note: str = "") -> str:
        code, body = self.post("/fleet/tokens", {"note": note})
        m = re.search(r'<pre id="enrollment-token">([^<]+)</pre>', body)
        if code != 200 or not m:
            raise RuntimeError(f"creating an enrollment token failed (HTTP {code})")
        return m.group(1).strip()

    def wait_for(self, what: str, check: Any, timeout_s: float = 300.0, every_s: float = 0.25) -> Any:
        """Poll the status until `check(status)` returns something truthy; raise with the last status."""
        last: list[dict[str, Any]] = [{}]

        def poll() -> Any:
            last[0] = self.status()
            return check(last[0])

        try:
            return wait_until(what, poll, timeout_s, every_s=every_s)
        except TimeoutError as e:
            raise TimeoutError(f"{e}; last status: {last[0]}") from None
