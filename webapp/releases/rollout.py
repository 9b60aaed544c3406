"""The rollout state machine, pure: which node to update next, what an agent's report means, when a
rollout is over. No database; `webapp.releases.services` feeds it rows and applies its decisions.

Rules (docs/control-plane.md, "Agent updates"):

* one node at a time: a node is sent the release only when no other node of the rollout is mid-update;
* nodes whose every shard has a ready replica elsewhere go first, so answers keep being served; a node
  that alone serves some layers waits until only such nodes are left;
* an offline node is skipped (it updates in a later rollout); a node already on the version is done;
* the first node that refuses, fails, rolls back or stays silent past the timeout stops the rollout
  (`failed`): a bad release reaches one node, never the fleet;
* a paused rollout sends nothing new but still records the reports of the node that was mid-update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Rollout states.
RUNNING, PAUSED, DONE, FAILED, CANCELLED = "running", "paused", "done", "failed", "cancelled"
ACTIVE = (RUNNING, PAUSED)
# Per-node states.
PENDING, SENT, UPDATED, SKIPPED = "pending", "sent", "updated", "skipped"
REFUSED, NODE_FAILED, ROLLED_BACK = "refused", "failed", "rolled_back"
NODE_TERMINAL = (UPDATED, SKIPPED, REFUSED, NODE_FAILED, ROLLED_BACK)
NODE_BAD = (REFUSED, NODE_FAILED, ROLLED_BACK)
# What an agent's `update_status` says (agent.wire.control.UpdateState) mapped onto a node state;
# the steps in between keep the node `sent` and are shown as its step.
REPORT_OUTCOME = {"updated": UPDATED, "refused": REFUSED, "failed": NODE_FAILED, "rolled_back": ROLLED_BACK}


@dataclass(frozen=True)
class NodeRow:
    """One node of a rollout as the machine sees it."""

    id: int  # the row's id
    node_id: str
    state: str
    position: int
    online: bool
    version: str  # what the node last said it runs
    sent_age_s: float | None = None  # seconds since the release was sent to it
    serves_alone: bool = False  # some layer it holds has no ready replica elsewhere


@dataclass
class Decision:
    """What to do now: rows to mark (state, error), the one row to send the release to, the new state."""

    marks: dict[int, tuple[str, str]] = field(default_factory=dict)
    send: int | None = None
    rollout_state: str | None = None  # None: unchanged


def step(rollout_state: str, version: str, rows: list[NodeRow], timeout_s: float) -> Decision:
    """The next move of a rollout of `version` over `rows`."""
    d = Decision()
    if rollout_state not in ACTIVE:
        return d
    states = {r.id: r.state for r in rows}
    for r in rows:
        if r.state == SENT and r.online and r.version == version:
            d.marks[r.id] = (UPDATED, "")  # its hello said so (the report may come after)
        elif r.state == SENT and r.sent_age_s is not None and r.sent_age_s > timeout_s:
            d.marks[r.id] = (NODE_FAILED, f"no report within {timeout_s:.0f} s")
        elif r.state == PENDING and r.version == version:
            d.marks[r.id] = (UPDATED, "already on this version")
    states.update({k: s for k, (s, _) in d.marks.items()})
    bad = [r for r in rows if states[r.id] in NODE_BAD]
    if bad:
        d.rollout_state = FAILED
        return d
    if any(s == SENT for s in states.values()) or rollout_state != RUNNING:
        return d
    waiting = sorted((r for r in rows if states[r.id] == PENDING), key=lambda r: (r.serves_alone, r.position))
    for r in waiting:
        if not r.online:
            d.marks[r.id] = (SKIPPED, "offline when its turn came")
            continue
        d.send = r.id
        return d
    d.rollout_state = DONE
    return d


def report(node_state: str, agent_state: str) -> str | None:
    """The node's new state after the agent reported `agent_state`; None: ignore the report.

    Only a node that was sent the release takes reports, so a late or repeated report (the agent says
    the last outcome on every reconnect) changes nothing once the node is settled.
    """
    if node_state != SENT:
        return None
    return REPORT_OUTCOME.get(agent_state, SENT)


def rollback_targets(rows: list[tuple[str, str, str]], version: str) -> dict[str, list[str]]:
    """{version to go back to: [node ids]} for rows (node_id, state, from_version) of a rollout.

    Nodes that took the release (or are taking it) go back to what they ran before; others are left.
    """
    out: dict[str, list[str]] = {}
    for node_id, state, from_version in rows:
        if state in (UPDATED, SENT) and from_version and from_version != version:
            out.setdefault(from_version, []).append(node_id)
    return out
