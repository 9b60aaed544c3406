"""The README's `up` command as a new user meets it: the printed URL loads in Chromium and a chat streams."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.procs import ProcessExited, free_port, spawn, stop, wait_log

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
PASSWORD = "e2e-Admin-pass-1"


@pytest.fixture(scope="module")
def swarm_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian chromium is not installed (scripts/setup.sh installs it)")
    tmp = tmp_path_factory.mktemp("up")
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}  # embedded defaults
    env.update(SWARM_DATA_DIR=str(tmp / "var"), SWARM_ADMIN_PASSWORD=PASSWORD, PYTHONUNBUFFERED="1")
    log = tmp / "up.log"
    proc = spawn([sys.executable, "scripts/up.py", "--port", str(free_port())], log, env=env, cwd=REPO)
    try:
        try:
            url = wait_log(log, r"GGUF Swarm is up: (http://\S+)", 420, procs=[proc], every_s=0.5).group(1)
        except (ProcessExited, TimeoutError) as e:
            pytest.fail(f"`up` did not print its URL: {e}\n{log.read_text()[-3000:]}")
        assert f"log in as admin / {PASSWORD}" in log.read_text()
        yield url
    finally:
        stop([proc], grace_s=30)  # its whole process group: `up` stops the servers and agents it started


def test_the_printed_url_loads_and_a_chat_answer_streams_into_the_page(swarm_up: str) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page()
            page.goto(swarm_up)
            assert "/accounts/login/" in page.url  # anonymous users are sent to log in
            page.fill("input[name=username]", "admin")
            page.fill("input[name=password]", PASSWORD)
            page.click("button[type=submit], input[type=submit]")
            page.goto(swarm_up.rstrip("/") + "/playground/")
            page.wait_for_selector("#chat-form select[name=model] option", state="attached")
            page.wait_for_function("() => document.querySelector('[ws-connect]') && window.htmx")
            page.fill("#chat-form textarea[name=message]", "Write three sentences about the sea.")
            page.click("#chat-form button[type=submit]")
            answer = page.wait_for_selector("[id^=answer-]", timeout=60_000)
            # Streaming: the answer grows through several distinct lengths before the telemetry arrives.
            lengths: list[int] = []
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                text = answer.inner_text()
                if not lengths or len(text) != lengths[-1]:
                    lengths.append(len(text))
                if "TTFT" in (page.inner_text("[id^=telemetry-]") or ""):
                    break
                time.sleep(0.02)
            telemetry = page.inner_text("[id^=telemetry-]")
            assert "TTFT" in telemetry and "tok/s" in telemetry
            assert len(answer.inner_text().strip()) > 20
            assert len([n for n in lengths if n > 0]) >= 3, lengths
            assert page.locator("[id^=telemetry-] .hop").count() == 2  # SmolLM2 is split across both agents
            assert page.inner_text("#chat-error").strip() == ""
        finally:
            browser.close()
