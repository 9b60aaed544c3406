"""Request bodies bounded by the web server itself, when the headers are in, before any body is read.

daphne (twisted.web underneath) reads a whole request body to memory or a temporary file before the
ASGI application is called, then queues all of it for the application at once: an anonymous 1 GiB POST
to /healthz was read in full (web RSS 558 -> 1,188 MB) before webapp.core.bodylimit's 413, and
/models/register took anonymous uploads of up to 64 GiB before sending the client to log in (issue 33).
`BoundedWebRequest` replaces daphne's request class (`install`, called by webapp.serve before daphne
starts) and applies bodylimit's limits at the two points twisted offers:

* `gotLength`, called once the headers are parsed and before any body byte is taken: a declared
  Content-Length past the limit is answered 413 and the connection closed, the body never read;
* `handleContentChunk`, for each piece of body as it arrives: a body without a declared length
  (chunked) is counted and refused the same way once it passes the limit, nothing past it kept.

Every path gets MAX_REQUEST_BYTES, uploads included, except a request to an upload path whose session
cookie belongs to a logged-in staff user: it gets bodylimit's upload limit. The session is looked up
in a thread (the reactor never waits on the database) while the connection is paused, so no body is
read meanwhile; `Expect: 100-continue` is answered only once the lookup passed. webapp.core.bodylimit
stays inside the application as the second line (other servers, tests that call the app directly).
"""

from __future__ import annotations

import logging
from importlib import import_module
from io import BytesIO
from typing import Any
from urllib.parse import unquote

import daphne.server  # type: ignore[import-untyped]  # noqa: F401 - no types; first: installs the reactor
from daphne import http_protocol
from django.conf import settings
from twisted.internet import threads

from webapp.core.bodylimit import limit_for

log = logging.getLogger(__name__)


def request_path(uri: bytes) -> str:
    """The path as daphne puts it in the ASGI scope (percent-decoded, no query); "" if not ASCII."""
    try:
        return unquote(uri.split(b"?", 1)[0].decode("ascii"))
    except UnicodeDecodeError:
        return ""


def may_upload(session_key: str) -> bool:
    """Whether `session_key` is the session of an active staff user: the only ones the models page
    takes uploads from (webapp.catalog.views). Runs in a thread: it reads the database."""
    from django.contrib.auth import get_user
    from django.db import close_old_connections
    from django.http import HttpRequest

    close_old_connections()
    try:
        request = HttpRequest()
        request.session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
        user = get_user(request)  # checks the session's password hash too, as the middleware does
        return bool(user.is_active and user.is_staff)
    except Exception:  # noqa: BLE001 - an unreadable session is no session: the small limit applies
        log.warning("session lookup for an upload failed", exc_info=True)
        return False
    finally:
        close_old_connections()


class BoundedWebRequest(http_protocol.WebRequest):  # daphne ships no types: an untyped base
    """daphne's request, refusing a body past its limit before reading it (see the module docstring)."""

    body_limit = 0
    body_seen = 0
    refused = False
    checking = False  # a session lookup for the upload limit is running; the connection is paused
    expect_continue = False
    declared: int | None = None  # the Content-Length, if any
    received: tuple[bytes, bytes, bytes] | None = None  # requestReceived's arguments, held while checking

    def gotLength(self, length: int | None) -> None:  # noqa: N802 - twisted's name
        path = request_path(getattr(self.channel, "_path", b"") or b"")
        self.declared = length
        self.body_limit = small = int(settings.MAX_REQUEST_BYTES)
        upload = limit_for(path)
        cookie = self.received_cookies.get(settings.SESSION_COOKIE_NAME.encode())
        if upload > small and (length is None or length > small) and cookie:
            self.body_limit = upload
            self._check_session(cookie.decode("latin-1"))
        if length is not None and length > self.body_limit:
            self.content = BytesIO()  # no temporary file for a body that will never come
            self.refuse(f"a request body of {length} bytes; the limit is {self.body_limit}")
            return
        super().gotLength(length)

    def _check_session(self, key: str) -> None:
        self.checking = True
        self.channel._networkProducer.pauseProducing()
        # twisted answers `Expect: 100-continue` right after gotLength: hold it until the lookup passed
        expect = self.requestHeaders.getRawHeaders(b"Expect") or []
        if expect and expect[0].lower() == b"100-continue":
            self.expect_continue = True
            self.requestHeaders.removeHeader(b"Expect")
        threads.deferToThread(may_upload, key).addBoth(self._session_checked)

    def _session_checked(self, ok: Any) -> None:
        self.checking = False
        if self.refused or self.channel is None:  # the client went meanwhile
            return
        small = int(settings.MAX_REQUEST_BYTES)
        if ok is not True:
            self.body_limit = small
            if self.declared is not None and self.declared > small:
                self.refuse(
                    f"a request body of {self.declared} bytes without a staff session; the limit is {small}"
                )
                return
        if self.expect_continue:
            self.channel._send100Continue()
        self.channel._networkProducer.resumeProducing()
        if self.received is not None:  # the whole body (within the ordinary limit) came meanwhile
            super().requestReceived(*self.received)

    def handleContentChunk(self, data: bytes) -> None:  # noqa: N802 - twisted's name
        if self.refused:
            return
        self.body_seen += len(data)
        # while the session lookup runs, at most the ordinary limit is kept (the socket is paused)
        limit = int(settings.MAX_REQUEST_BYTES) if self.checking else self.body_limit
        if self.body_seen > limit:
            self.refuse(f"a request body past {limit} bytes; the limit is {self.body_limit}")
            return
        super().handleContentChunk(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:  # noqa: N802
        if self.refused:  # a refused body never reaches the application
            return
        if self.checking:  # the whole (small) body came before the lookup answered: wait for it
            self.received = (command, path, version)
            return
        super().requestReceived(command, path, version)

    def refuse(self, reason: str) -> None:
        """413 with `reason`, then close the connection without reading the rest of the body."""
        self.refused = True
        self.requestHeaders.removeHeader(b"Expect")  # or twisted would still say 100 Continue after it
        channel = self.channel
        if channel is None or channel.transport is None:
            return
        body = f"413 Content Too Large: {reason}\n".encode()
        head = (
            b"HTTP/1.1 413 Content Too Large\r\n"
            b"Content-Type: text/plain; charset=utf-8\r\n"
            b"Content-Length: %d\r\n"
            b"Connection: close\r\n\r\n" % len(body)
        )
        peer = getattr(channel.transport.getPeer(), "host", "?")
        log.info("refused a request body from %s before reading it: %s", peer, reason)
        channel.transport.write(head + body)
        channel.loseConnection()


class BoundedHTTPFactory(http_protocol.HTTPFactory):  # daphne ships no types: an untyped base
    """daphne's HTTP factory, making `BoundedWebRequest`s."""

    def buildProtocol(self, addr: Any) -> Any:  # noqa: N802 - twisted's name
        protocol = super().buildProtocol(addr)
        protocol.requestFactory = BoundedWebRequest
        return protocol


def install() -> None:
    """Make daphne's server build its HTTP connections with `BoundedHTTPFactory`."""
    daphne.server.HTTPFactory = BoundedHTTPFactory
