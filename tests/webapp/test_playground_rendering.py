"""The playground page in Chromium with the websocket answered by the test (the consumer's seam): Markdown and
code blocks render, model-written HTML is shown as text and never runs, Enter/Shift+Enter, Stop, errors.

The page and the conversation JSON come from the real Django views (test client); static files from disk.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from webapp.playground.models import Conversation, Message

# Committed rows: Playwright calls the page's request handler in another context, which Django gives
# its own database connection.
pytestmark = pytest.mark.django_db(transaction=True)
REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
BASE = "http://playground.test"
EVIL = (
    "Here you go:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n"
    '<script>window.__pwned = 1</script> and <img src=x onerror="window.__pwned = 2"> '
    "[click](javascript:window.__pwned=3)"
)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian chromium is not installed (scripts/setup.sh installs it)")
    if not (REPO / "static/vendor/markdown-it.min.js").exists():
        pytest.skip("static/vendor/ is empty: run `npm install` (scripts/copy-vendor.mjs)")
    sync_api = pytest.importorskip("playwright.sync_api")
    # Playwright's sync API keeps an event loop in this thread; the Django calls made here (the page's
    # requests, fixtures) are still plain synchronous code of one thread.
    with pytest.MonkeyPatch.context() as mp, sync_api.sync_playwright() as p:
        mp.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "1")
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


class FakeServer:
    """Answers the page's websocket like ChatConsumer does, with scripted events per chat message."""

    def __init__(self) -> None:
        self.received: list[dict[str, Any]] = []
        self.script: list[list[dict[str, Any]]] = []
        self.ws: Any = None

    def handle(self, ws: Any) -> None:
        self.ws = ws
        ws.on_message(self.on_message)

    def on_message(self, raw: str | bytes) -> None:
        msg = json.loads(raw)
        self.received.append(msg)
        if msg.get("type") == "chat" and self.script:
            for ev in self.script.pop(0):
                self.ws.send(json.dumps(ev))

    def send(self, ev: dict[str, Any]) -> None:
        self.ws.send(json.dumps(ev))


@pytest.fixture
def page(browser: Any, member_client: Any, artifact: Any) -> Iterator[tuple[Any, FakeServer]]:
    ctx = browser.new_context(base_url=BASE)
    pg = ctx.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))

    def serve(route: Any) -> None:
        req = route.request
        path = req.url.removeprefix(BASE)
        if path.startswith("/static/"):
            f = REPO / "static" / path.removeprefix("/static/").split("?")[0]
            route.fulfill(path=str(f)) if f.is_file() else route.fulfill(status=404)
            return
        try:
            if req.method == "POST":
                form = req.post_data or ""
                r = member_client.post(path, form, content_type="application/x-www-form-urlencoded")
            else:
                r = member_client.get(path)
        finally:
            connection.close()  # this context's own connection would outlive the test database
        route.fulfill(status=r.status_code, body=r.content, headers={"Content-Type": r["Content-Type"]})

    pg.route(f"{BASE}/**", serve)
    server = FakeServer()
    pg.route_web_socket(re.compile(r".*/ws/chat/.*"), server.handle)
    yield pg, server
    ctx.close()
    assert not errors, errors


def answer_events(conversation: int, text: str, *, stopped: bool = False) -> list[dict[str, Any]]:
    half = len(text) // 2
    hops = [
        {"url": "http://a", "layers": [0, 15], "compute_ms": 40.0, "network_ms": 5.0},
        {"url": "http://b", "layers": [15, 30], "compute_ms": 20.0, "network_ms": 10.0},
    ]
    telemetry = {
        "ttft_ms": 50,
        "tok_s": 30.0,
        "n_prompt": 12,
        "n_reused": 0,
        "n_prefilled": 12,
        "n_generated": 9,
        "hops": hops,
    }
    if stopped:
        telemetry = {"stopped": True, "n_generated": 9, "hops": hops}
    return [
        {
            "turn": 1,
            "conversation": conversation,
            "type": "start",
            "title": "Code please",
            "created": True,
            "route": [{"node": "n1", "layer_start": 0, "layer_end": 15}],
            "context": 8192,
        },
        {"turn": 1, "conversation": conversation, "type": "delta", "text": text[:half]},
        {"turn": 1, "conversation": conversation, "type": "delta", "text": text[half:]},
        {
            "turn": 1,
            "conversation": conversation,
            "type": "done",
            "text": text,
            "stopped": stopped,
            "telemetry": telemetry,
            "bars": [],
        },
    ]


def open_playground(pg: Any, query: str = "") -> None:
    pg.goto(f"{BASE}/playground/{query}")
    pg.wait_for_selector("#pg-conn.ok")


def test_a_streamed_answer_renders_markdown_and_code_while_html_from_the_model_stays_text(page: Any) -> None:
    pg, server = page
    server.script.append(answer_events(41, EVIL))
    open_playground(pg)
    pg.fill("#pg-input", "Code please")
    pg.press("#pg-input", "Enter")
    pg.wait_for_selector(".msg.assistant[data-done='1']")
    body = pg.locator(".msg.assistant .msg-body")
    assert (
        pg.locator(".msg.assistant .codeblock pre code.language-python")
        .inner_text()
        .startswith("def add(a, b):")
    )
    assert pg.locator(".msg.assistant .codeblock-bar button.copy").count() == 1
    text = body.inner_text()
    assert "<script>window.__pwned = 1</script>" in text and "<img src=x" in text
    assert body.locator("script, img, iframe").count() == 0
    assert body.locator("a[href^='javascript']").count() == 0
    assert pg.evaluate("window.__pwned") is None
    # The new conversation shows in the list and in the URL (so a reload reopens it).
    assert pg.locator("#pg-list .conv[data-id='41']").inner_text().startswith("Code please")
    assert pg.url.endswith("?c=41")
    assert pg.locator(".msg.assistant .hop").count() == 2
    assert "TTFT 50 ms" in pg.locator(".msg.assistant .telemetry").inner_text()


def test_a_stored_answer_with_a_script_is_shown_as_text_when_the_conversation_is_reopened(
    page: Any, member: Any, artifact: Any
) -> None:
    pg, _ = page
    conv = Conversation.objects.create(
        user=member, artifact=artifact, title="Stored", system_prompt="Be kind."
    )
    Message.objects.create(conversation=conv, role="user", content="<b>bold?</b>")
    Message.objects.create(conversation=conv, role="assistant", content=EVIL, telemetry={"n_generated": 3})
    open_playground(pg, f"?c={conv.pk}")
    pg.wait_for_selector(".msg.assistant .codeblock")
    assert pg.locator(".msg.user").inner_text() == "<b>bold?</b>"
    assert "<script>window.__pwned = 1</script>" in pg.locator(".msg.assistant .msg-body").inner_text()
    assert pg.locator(".msg-body script, .msg-body img, .msg.user b").count() == 0
    assert pg.evaluate("window.__pwned") is None
    assert pg.input_value("#pg-system") == "Be kind." and pg.inner_text("#pg-title") == "Stored"


def test_enter_sends_shift_enter_breaks_the_line_and_stop_asks_the_server_to_stop(page: Any) -> None:
    pg, server = page
    open_playground(pg)
    pg.click("#pg-input")
    pg.keyboard.type("line one")
    pg.keyboard.press("Shift+Enter")
    pg.keyboard.type("line two")
    assert not [m for m in server.received if m.get("type") == "chat"]
    pg.fill("#pg-temperature", "0.7")
    pg.fill("#pg-seed", "42")
    pg.fill("#pg-system", "Be brief.")
    pg.press("#pg-input", "Enter")
    pg.wait_for_selector("#pg-stop:not([hidden])")
    chat = next(m for m in server.received if m.get("type") == "chat")
    assert chat["message"] == "line one\nline two" and chat["conversation"] is None
    assert (chat["temperature"], chat["seed"], chat["system"]) == ("0.7", "42", "Be brief.")
    assert pg.input_value("#pg-input") == ""
    events = answer_events(7, "partial answer", stopped=True)
    for ev in events[:2]:
        server.send(ev)
    pg.wait_for_function(
        "() => document.querySelector('.msg.assistant .msg-body').textContent.includes('partial')"
    )
    pg.click("#pg-stop")
    pg.wait_for_function("() => document.querySelector('#pg-stop').disabled")
    assert server.received[-1] == {"type": "stop"}
    server.send(events[3])
    pg.wait_for_selector(".msg.assistant.stopped[data-done='1']")
    assert "stopped after 9 tokens" in pg.inner_text(".msg.assistant .telemetry")
    assert pg.locator("#pg-stop").is_hidden() and pg.locator("#pg-send").is_enabled()


def test_a_turn_that_gets_no_route_shows_why_and_gives_the_text_back(page: Any) -> None:
    pg, server = page
    why = "SmolLM2 is not placed so that it can answer: no ready shard starts at layer 0."
    server.script.append([{"turn": 1, "type": "error", "error": why}])
    open_playground(pg)
    assert "is not placed on any node yet" in pg.inner_text("#pg-banner")  # the model has no shards
    pg.fill("#pg-input", "hello?")
    pg.press("#pg-input", "Enter")
    pg.wait_for_function("() => document.querySelector('#pg-banner').textContent.includes('no ready shard')")
    assert pg.locator(".msg").count() == 0 and pg.input_value("#pg-input") == "hello?"
    assert pg.locator("#pg-send").is_enabled()


def test_a_conversation_is_renamed_and_deleted_from_the_list(page: Any, member: Any, artifact: Any) -> None:
    pg, _ = page
    keep = Conversation.objects.create(user=member, artifact=artifact, title="Keep me")
    gone = Conversation.objects.create(user=member, artifact=artifact, title="Old name")
    open_playground(pg, f"?c={gone.pk}")
    row = pg.locator(f"#pg-list .conv[data-id='{gone.pk}']")
    row.hover()
    row.locator("button.rename").click()
    pg.fill(".conv-rename", "New name")
    pg.press(".conv-rename", "Enter")
    pg.wait_for_function(
        f"() => document.querySelector(\"#pg-list .conv[data-id='{gone.pk}']\").textContent.includes('New name')"
    )
    gone.refresh_from_db()
    assert gone.title == "New name" and pg.inner_text("#pg-title") == "New name"
    pg.once("dialog", lambda d: d.accept())
    row.hover()
    row.locator("button.delete").click()
    pg.wait_for_selector(f"#pg-list .conv[data-id='{gone.pk}']", state="detached")
    assert (
        not Conversation.objects.filter(pk=gone.pk).exists()
        and Conversation.objects.filter(pk=keep.pk).exists()
    )
    assert pg.inner_text("#pg-title") == "New chat" and "?c=" not in pg.url
