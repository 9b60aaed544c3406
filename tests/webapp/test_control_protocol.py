"""Parsing agents' control messages and reconciling a node with its assignments (pure)."""

from __future__ import annotations

import pytest

from webapp.fleet.protocol import (
    AssignmentView,
    Hello,
    Progress,
    ProtocolError,
    ShardRef,
    Telemetry,
    choose_backend,
    parse_agent_message,
    reconcile,
)

SHA = "ab" * 32


def test_a_hello_is_parsed_with_its_shards() -> None:
    msg = parse_agent_message(
        {
            "type": "hello",
            "hardware": {"cpu_count": 2},
            "backends": ["torch"],
            "version": "0.1.0",
            "dataplane_url": "http://127.0.0.1:9000",
            "speed": 12.5,
            "free_memory_bytes": 10,
            "shards": [{"model_sha256": SHA, "layer_start": 0, "layer_end": 15}],
        }
    )
    assert isinstance(msg, Hello)
    assert msg.shards == [ShardRef(SHA, 0, 15)] and msg.speed == 12.5


def test_a_heartbeat_becomes_telemetry_with_defaults() -> None:
    msg = parse_agent_message({"type": "heartbeat", "telemetry": {"sessions": 2, "kv_bytes": 5}})
    assert isinstance(msg, Telemetry) and msg.sessions == 2 and msg.kv_budget_bytes == 0


def test_a_progress_report_is_parsed() -> None:
    msg = parse_agent_message({"type": "progress", "assignment_id": 3, "state": "fetching", "progress": 0.5})
    assert msg == Progress(3, "fetching", 0.5, "")


def test_a_progress_report_keeps_only_the_known_numbers_of_its_transfer() -> None:
    transfer = {
        "done_bytes": 10,
        "wanted_bytes": 20,
        "peers": 2,
        "peer_bytes": 4,
        "source": "swarm",
        "x": "y",
    }
    msg = parse_agent_message(
        {"type": "progress", "assignment_id": 3, "state": "fetching", "progress": 0.5, "transfer": transfer}
    )
    assert isinstance(msg, Progress)
    assert msg.transfer == {
        "done_bytes": 10,
        "wanted_bytes": 20,
        "peers": 2,
        "peer_bytes": 4,
        "source": "swarm",
    }


@pytest.mark.parametrize(
    ("msg", "error"),
    [
        ([], "JSON object"),
        ({"type": "nope"}, "unknown message type"),
        ({"type": "progress", "assignment_id": "1", "state": "ready"}, "assignment_id"),
        ({"type": "progress", "assignment_id": 1, "state": "exploded"}, "'state' must be one of"),
        ({"type": "hello", "backends": "torch"}, "backends"),
        ({"type": "hello", "dataplane_url": "ftp://x"}, "http"),
        ({"type": "heartbeat", "telemetry": {"sessions": True}}, "sessions"),
        ({"type": "hello", "shards": [{"model_sha256": SHA, "layer_start": 0}]}, "layer_end"),
        ({"type": "progress", "assignment_id": 1, "state": "fetching", "transfer": [1]}, "'transfer'"),
        (
            {"type": "progress", "assignment_id": 1, "state": "fetching", "transfer": {"peers": -1}},
            "negative",
        ),
    ],
)
def test_malformed_messages_raise_a_protocol_error_saying_what_is_wrong(msg: object, error: str) -> None:
    with pytest.raises(ProtocolError, match=error):
        parse_agent_message(msg)


def view(i: int, a: int, b: int, state: str = "assigned") -> AssignmentView:
    return AssignmentView(i, SHA, a, b, state, "torch")


def test_reconcile_marks_held_shards_ready_and_resends_missing_loads() -> None:
    ready, commands = reconcile(
        [view(1, 0, 15, "ready"), view(2, 15, 30, "fetching")], [ShardRef(SHA, 0, 15)]
    )
    assert ready == [1]
    assert [(c["type"], c["assignment_id"]) for c in commands] == [("load", 2)]
    assert commands[0]["file_url"] == f"/artifacts/{SHA}/file"


def test_reconcile_unloads_shards_nobody_assigned_and_ignores_failed_ones() -> None:
    ready, commands = reconcile([view(1, 0, 15, "failed")], [ShardRef(SHA, 0, 15), ShardRef(SHA, 15, 30)])
    assert ready == []
    assert [(c["type"], c["layer_start"]) for c in commands] == [("unload", 0), ("unload", 15)]


def test_reconcile_unloads_a_draining_assignment_the_node_still_holds() -> None:
    _, commands = reconcile([view(7, 0, 30, "draining")], [ShardRef(SHA, 0, 30)])
    assert commands == [
        {"type": "unload", "assignment_id": 7, "model_sha256": SHA, "layer_start": 0, "layer_end": 30}
    ]


def test_llamacpp_is_only_chosen_for_a_full_model_shard() -> None:
    assert choose_backend(["llamacpp", "torch"], full_model=False) == "torch"
    assert choose_backend(["llamacpp", "torch"], full_model=True) == "llamacpp"
    assert choose_backend(["native", "torch"], full_model=False, preferred="torch") == "torch"
    assert choose_backend(["native", "torch"], full_model=False, preferred="cuda") == "native"
