"""Playground: the browser chat that streams tokens over a websocket, and `manage.py swarm_up` (the demo that ends in it)."""
