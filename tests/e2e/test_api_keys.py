"""An API key made in the web UI (Chromium, the `up` stack) works from the official `openai` client."""

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
        yield url.rstrip("/")
    finally:
        stop([proc], grace_s=30)  # its whole process group: `up` stops the servers and agents it started


def test_a_key_created_in_the_ui_answers_through_the_openai_client_and_stops_when_revoked(
    swarm_up: str,
) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    openai = pytest.importorskip("openai")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"],
        )
        try:
            page = browser.new_page()
            page.goto(swarm_up + "/accounts/login/")
            page.fill("input[name=username]", "admin")
            page.fill("input[name=password]", PASSWORD)
            page.click("button[type=submit], input[type=submit]")
            page.click("header.top a:has-text('API keys')")
            page.wait_for_selector("#create-key")
            page.fill("#create-key input[name=name]", "from the browser")
            page.click("#create-key button[type=submit]")
            secret = page.inner_text("#new-key-secret").strip()
            assert secret.startswith("sk-swarm-")
            row = page.locator("#keys tr", has_text="from the browser")
            assert row.count() == 1 and secret[:15] in row.inner_text()

            client = openai.OpenAI(base_url=swarm_up + "/v1", api_key=secret, max_retries=0, timeout=120)
            model = ""
            deadline = time.monotonic() + 300
            while not model:  # `up` places SmolLM2 as it starts: poll until it is listed and routable
                ids = [m.id for m in client.models.list()]
                try:
                    r = client.chat.completions.create(
                        model=ids[0],
                        messages=[{"role": "user", "content": "Say hello."}],
                        max_tokens=12,
                        temperature=0,
                    )
                    model = ids[0]
                except (IndexError, openai.NotFoundError, openai.InternalServerError):
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1)
            assert (r.choices[0].message.content or "").strip()
            assert r.usage is not None and r.usage.completion_tokens > 0

            page.goto(swarm_up + "/api-keys/")  # the page never shows the secret again, and shows usage
            assert secret not in page.content()
            row = page.locator("#keys tr", has_text="from the browser")
            assert f"/ {r.usage.completion_tokens}" in row.inner_text()
            row.locator("button:has-text('Revoke')").click()
            page.wait_for_selector("#keys tr:has-text('from the browser') .badge:has-text('revoked')")
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        finally:
            browser.close()
