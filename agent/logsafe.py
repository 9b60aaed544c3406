"""Secrets never reach a log: a redaction function, a logging filter and a redacting text stream.

What counts as a secret here: tracker/web-seed passkeys (in URL paths and on their own), node secrets
(`sec_...`, `Authorization: Node id:secret`), enrollment tokens (`enr_...`), API keys (`sk-swarm-...`),
bearer tokens (route tokens travel as bearer credentials), and the value of any `password=`, `token=`,
`secret=`, `passkey=`, `api_key=` or `authorization` field. docs/security.md lists where each is used.

Both the web process and the agents install it (`install()`); the web server's access log is not a
logging record but a stream write (daphne), which is why the stream wrapper exists. Imports nothing
of ours, so any layer may use it.
"""

from __future__ import annotations

import logging
import re
from typing import Any, TextIO

REDACTED = "[redacted]"

_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    # /tracker/<passkey>/announce, /webseed/<passkey>/<sha>: the path segment is the credential.
    (re.compile(r"(/(?:tracker|webseed)/)[^/\s\"'?#]+"), r"\1" + REDACTED),
    # A passkey on its own: <node id>.<32 hex> or <node id>.<generation>.<32 hex>.
    (re.compile(r"\bnode-[0-9a-f]+(?:\.\d+)?\.[0-9a-f]{32}\b"), REDACTED),
    (re.compile(r"\b(?:sk-swarm-|enr_|sec_)[A-Za-z0-9_\-]{8,}"), REDACTED),
    (re.compile(r"(?i)\b(Node\s+[A-Za-z0-9_.\-]+:)\S+"), r"\1" + REDACTED),
    (re.compile(r"(?i)\b(Bearer\s+)[A-Za-z0-9_.~+/=\-]+"), r"\1" + REDACTED),
    # key=value, key: value, "key": "value" for the field names that carry secrets.
    (
        re.compile(
            r"(?i)\b((?:password|passwd|passkey|secret|token|route_token|api_key|apikey|authorization"
            r"|csrfmiddlewaretoken|sessionid)[\"']?\s*[:=]\s*[\"']?)(?!\[redacted\])[^\s\"'&,;}]+"
        ),
        r"\1" + REDACTED,
    ),
]


def redact(text: str) -> str:
    """`text` with every secret this module knows the shape of replaced by `[redacted]`."""
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


class RedactSecrets(logging.Filter):
    """A handler filter: formats the record's message (and exception text) once, redacted."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except (TypeError, ValueError):  # a bad format string: keep what can be shown
            message = str(record.msg)
        record.msg, record.args = redact(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


class RedactingStream:
    """A text stream wrapper that redacts each line written (the ASGI server's access log is a stream).

    Writes are buffered to the end of the line so a secret split across two writes is still caught.
    """

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner
        self._pending = ""

    def write(self, s: str) -> int:
        self._pending += s
        if "\n" in self._pending:
            done, _, self._pending = self._pending.rpartition("\n")
            self._inner.write(redact(done + "\n"))
            self._inner.flush()
        return len(s)

    def flush(self) -> None:
        if self._pending:
            self._inner.write(redact(self._pending))
            self._pending = ""
        self._inner.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def install(logger: logging.Logger | None = None) -> None:
    """Put the filter on every handler of `logger` (the root logger by default) that lacks it."""
    target = logger or logging.getLogger()
    for handler in target.handlers:
        if not any(isinstance(f, RedactSecrets) for f in handler.filters):
            handler.addFilter(RedactSecrets())
