"""What a route client raises: a hop's refusal or failure, the context cap, recovery giving up."""

from __future__ import annotations


class RouteError(Exception):
    """A hop refused or failed a request; `status` and `code` come from the hop when it answered."""

    def __init__(self, message: str, status: int = 0, code: str = "", hop: int = -1) -> None:
        super().__init__(message)
        self.status, self.code, self.hop = status, code, hop


class ContextLimitError(RouteError):
    """The conversation no longer fits the context cap (128K or the model's own limit)."""


class RouteFailed(RouteError):
    """Recovery gave up: no replacement for a range, or too many failures in a row (never retried)."""
