"""Issue 17, secrets never in logs: the redaction filter, the web server's access log, log file modes,
and the admin password `make up` prints.

The attack: tracker passkey URLs landed in var/logs/web.log (mode 0644) through daphne's access log;
with one, anyone could download the model and feed fake peers to real nodes. The admin password was
printed into a log file too.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import stat
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from agent import procs
from agent.logsafe import REDACTED, RedactingStream, RedactSecrets, redact
from webapp.fleet.passkeys import derive_passkey
from webapp.playground.management.commands.swarm_up import password_notice, private_log

REPO = Path(__file__).resolve().parents[2]
PASSKEY = derive_passkey("not-the-real-secret-key", "node-0123456789ab")
SECRETS = {
    "passkey in a tracker URL": (f"GET /tracker/{PASSKEY}/announce?info_hash=x", PASSKEY),
    "passkey in a web seed URL": (f'"GET /webseed/{PASSKEY}/{"a" * 64}" 403', PASSKEY),
    "passkey on its own": (f"announce with {PASSKEY} refused", PASSKEY),
    "rotated passkey": (
        f"/tracker/{derive_passkey('k', 'node-ab', 3)}/scrape",
        derive_passkey("k", "node-ab", 3),
    ),
    "node secret": ("Authorization: Node node-1:sec_abcdefghijklmnop", "sec_abcdefghijklmnop"),
    "enrollment token": ("token enr_Zm9vYmFyYmF6cXV4 redeemed", "enr_Zm9vYmFyYmF6cXV4"),
    "API key": ("key sk-swarm-0123456789abcdef used", "sk-swarm-0123456789abcdef"),
    "bearer route token": ("Authorization: Bearer eyJhbGciOi.abc-def_ghi", "eyJhbGciOi.abc-def_ghi"),
    "password field": ("username=admin&password=hunter2hunter2", "hunter2hunter2"),
    "json password": ('{"password": "s3cr3t-pass"}', "s3cr3t-pass"),
}


@pytest.mark.parametrize("case", sorted(SECRETS))
def test_the_filter_redacts_every_kind_of_secret(case: str) -> None:
    text, secret = SECRETS[case]
    out = redact(text)
    assert secret not in out and REDACTED in out


def test_ordinary_log_lines_are_left_alone() -> None:
    line = "node-0123 heartbeat: sessions=3 tokens_served=120 max_tokens=24 GET /fleet/ 200"
    assert redact(line) == line


def test_the_logging_filter_redacts_arguments_and_tracebacks() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RedactSecrets())
    log = logging.getLogger("test.security.logs")
    log.addHandler(handler)
    try:
        log.warning("announce from %s", f"/tracker/{PASSKEY}/announce")
        try:
            raise ValueError(f"bad passkey {PASSKEY}")
        except ValueError:
            log.exception("refused")
    finally:
        log.removeHandler(handler)
    assert PASSKEY not in out.getvalue() and out.getvalue().count(REDACTED) >= 2


def test_the_redacting_stream_catches_a_secret_split_across_writes() -> None:
    out = io.StringIO()
    s = RedactingStream(out)
    s.write("GET /tracker/" + PASSKEY[:10])
    s.write(PASSKEY[10:] + "/announce 200\n")
    s.flush()
    assert PASSKEY not in out.getvalue() and REDACTED in out.getvalue()


def test_a_request_with_a_passkey_leaves_no_passkey_in_the_web_log(tmp_path: Path) -> None:
    """The real web server (`python -m webapp.serve`, as `make up` starts it) with its access log on."""
    logs = tmp_path / "logs"
    logs.mkdir()
    port = procs.free_port()
    env = {**os.environ, "SWARM_DATA_DIR": str(tmp_path), "LOG_LEVEL": "DEBUG"}
    env.pop("DATABASE_URL", None)  # a wrong passkey is refused before any database query
    log = private_log(logs / "web.log")
    web = procs.spawn(
        [sys.executable, "-m", "webapp.serve", "-b", "127.0.0.1", "-p", str(port), "webapp.asgi:application"],
        log,
        env=env,
        cwd=REPO,
        append=True,
    )
    try:
        procs.wait_http(f"http://127.0.0.1:{port}/healthz", 60, procs=[web])
        for path in (f"/tracker/{PASSKEY}/announce?info_hash=x", f"/webseed/{PASSKEY}/{'a' * 64}"):
            # 403 for the unknown passkey: what matters is the access log line.
            with contextlib.suppress(urllib.error.HTTPError):
                urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10).read()
        # Readiness of the log: the access log line of the last request is written when it completes.
        procs.wait_until("the access log line", lambda: "/webseed/" in log.read_text(), 10)
    finally:
        procs.stop([web])
    text = "".join(p.read_text() for p in logs.glob("*.log"))
    assert "/tracker/" in text and "/webseed/" in text  # the requests were logged...
    assert PASSKEY not in text and PASSKEY[-32:] not in text  # ...without their passkey
    assert stat.S_IMODE(log.stat().st_mode) == 0o600


def test_log_files_are_created_owner_only_even_when_they_existed(tmp_path: Path) -> None:
    old = tmp_path / "web.log"
    old.write_text("earlier run\n")
    old.chmod(0o644)
    assert stat.S_IMODE(private_log(old).stat().st_mode) == 0o600
    assert stat.S_IMODE(private_log(tmp_path / "new.log").stat().st_mode) == 0o600


@pytest.mark.parametrize(
    ("fresh", "tty", "shown"), [(True, True, True), (True, False, False), (False, True, False)]
)
def test_the_admin_password_is_shown_once_and_only_on_a_terminal(
    fresh: bool, tty: bool, shown: bool, monkeypatch: Any
) -> None:
    monkeypatch.delenv("SWARM_ADMIN_PASSWORD", raising=False)
    notice = password_notice("pw-8f3a9c1d2e", fresh, tty)
    assert ("pw-8f3a9c1d2e" in notice) is shown
    assert "admin_password" in notice  # always says where it is kept (0600)
