"""ASGI entry point: HTTP through Django, websockets through Channels (agents and browsers)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
django_http = get_asgi_application()

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from webapp.core.bodylimit import BodyLimit  # noqa: E402
from webapp.fleet.services import record_web_start  # noqa: E402
from webapp.ws_urls import agent_websocket_urlpatterns, browser_websocket_urlpatterns  # noqa: E402

if TYPE_CHECKING:
    from asgiref.typing import ASGIReceiveCallable, ASGISendCallable, WebSocketScope


class _WebsocketRouter:
    """Agents (no Origin header, node credentials) and browsers (same-origin only, session auth)."""

    def __init__(self) -> None:
        self.agents = URLRouter(agent_websocket_urlpatterns)
        self.browsers = AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter(browser_websocket_urlpatterns))
        )

    async def __call__(
        self, scope: WebSocketScope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        app = self.agents if scope.get("path", "").startswith("/ws/agent/") else self.browsers
        await app(scope, receive, send)


application = ProtocolTypeRouter(
    {
        "http": BodyLimit(ASGIStaticFilesHandler(django_http) if settings.SERVE_STATIC else django_http),
        "websocket": _WebsocketRouter(),
    }
)

# Agents could not heartbeat while this process was down: the sweeper counts their silence from here.
try:
    record_web_start()
except Exception:  # noqa: BLE001 - a cache down at start is the channel layer's error to report; this is a grace
    logging.getLogger(__name__).warning("could not record the web process's start", exc_info=True)
