"""Publishing Celery tasks from a request: a broker that cannot take the task is the caller's answer."""

from __future__ import annotations

import logging
from typing import Any

from celery import Task
from celery.result import AsyncResult
from kombu.exceptions import OperationalError

log = logging.getLogger(__name__)

# What a staff member reads when a publish failed (kombu's own message names sockets, not the queue).
BROKER_REFUSED = "The task queue (Redis) did not take the request, so nothing was changed. Try again shortly."


class BrokerUnavailable(Exception):
    """The broker refused or did not answer within CELERY_BROKER_TRANSPORT_OPTIONS' timeouts."""


def publish(task: Task, *args: Any) -> AsyncResult:
    """`task.delay(*args)`, or BrokerUnavailable (logged) when the broker cannot take it. Eager mode (the
    embedded defaults) runs the task in place and never reaches a broker."""
    try:
        return task.delay(*args)
    except OperationalError as e:
        log.warning("task %s%r not published: the broker did not take it (%s)", task.name, args, e)
        raise BrokerUnavailable(BROKER_REFUSED) from e
