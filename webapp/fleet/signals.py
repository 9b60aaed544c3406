"""Fleet events that higher apps listen to (they import fleet; fleet never imports them).

Sent from the agent consumer's synchronous side, inside no transaction.
"""

from __future__ import annotations

from django.dispatch import Signal

# An agent said hello: node_id, version.
node_hello = Signal()
# An agent reported on an `update`: node_id, status (agent.wire.control.UpdateStatus).
update_reported = Signal()
