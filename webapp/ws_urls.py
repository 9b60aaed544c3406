"""Websocket URL routes (agents, dashboards, playground)."""

from __future__ import annotations

from django.urls import path

from webapp.fleet.consumers import AgentConsumer, FleetConsumer
from webapp.playground.consumers import ChatConsumer

agent_websocket_urlpatterns = [path("ws/agent/", AgentConsumer.as_asgi())]
browser_websocket_urlpatterns = [
    path("ws/fleet/", FleetConsumer.as_asgi()),
    path("ws/chat/", ChatConsumer.as_asgi()),
]
