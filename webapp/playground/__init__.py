"""Playground: the browser chat that streams tokens over a websocket."""
