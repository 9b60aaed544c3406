"""Routing websockets (none: routes are opened by the playground consumer and, later, the API)."""
