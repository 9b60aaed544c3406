"""The control channel's shared schema (agent.wire.control) and the control plane's pure decisions on it."""

from __future__ import annotations

import json

import pytest

from agent.wire.control import (
    CLOSE_REMOVED,
    CLOSE_REPLACED,
    CLOSE_UNAUTHORIZED,
    FINAL_CLOSE_CODES,
    MAX_MESSAGE_BYTES,
    MAX_STR,
    PROTOCOL_VERSION,
    ControlError,
    Drain,
    ErrorMessage,
    Gpu,
    Hardware,
    Heartbeat,
    Hello,
    Load,
    Progress,
    Removed,
    Resync,
    ShardRef,
    Telemetry,
    Transfer,
    Unload,
    Welcome,
    parse_agent_message,
    parse_server_message,
)
from webapp.fleet.protocol import AssignmentView, choose_backend, load_command, reconcile

SHA = "ab" * 32


def over_the_wire(msg: Hello | Heartbeat | Progress | ErrorMessage | Welcome | Load | Unload) -> object:
    """What the other end decodes: the message as JSON text and back."""
    return json.loads(json.dumps(msg.to_wire()))


AGENT_MESSAGES = [
    Hello(
        version="0.1.0",
        hardware=Hardware(
            hostname="h",
            platform="Linux",
            python="3.11",
            cpu_count=2,
            memory_bytes=8 << 30,
            gpus=[Gpu(name="H200", memory_bytes=141 << 30)],
        ),
        backends=["native", "torch"],
        dataplane_url="http://127.0.0.1:9000",
        speed=12.5,
        free_memory_bytes=10,
        shards=[ShardRef(model_sha256=SHA, layer_start=0, layer_end=15)],
    ),
    Heartbeat(telemetry=Telemetry(sessions=2, kv_bytes=5, kv_budget_bytes=9, tok_s=3.5, shards=1)),
    Progress(assignment_id=3, state="fetching", progress=0.5),
    Progress(
        assignment_id=3,
        state="fetching",
        progress=0.25,
        transfer=Transfer(
            done_bytes=1, wanted_bytes=4, rate_bytes_per_s=2.5, source="swarm", infohash="f" * 40
        ),
    ),
    Progress(assignment_id=4, state="failed", error="manifest: HTTP 404"),
    ErrorMessage(error="bad 'load' message"),
]
SERVER_MESSAGES = [
    Welcome(node_id="node-1", heartbeat_interval_s=3),
    Load(
        assignment_id=1,
        model_sha256=SHA,
        layer_start=0,
        layer_end=15,
        backend="native",
        manifest_url=f"/artifacts/{SHA}/manifest",
        file_url=f"/artifacts/{SHA}/file",
        torrent_url=f"/artifacts/{SHA}/torrent",
        trackers=["/tracker/k/announce"],
        web_seeds=[f"/webseed/k/{SHA}"],
    ),
    Unload(assignment_id=7, model_sha256=SHA, layer_start=0, layer_end=30),
    Unload(model_sha256=SHA, layer_start=0, layer_end=30),
    Drain(),
    Resync(),
    Removed(),
    ErrorMessage(error="assignment 3 is not yours or is draining"),
]


@pytest.mark.parametrize("msg", AGENT_MESSAGES, ids=lambda m: m.type)
def test_every_agent_message_survives_the_wire_unchanged(msg: Hello) -> None:
    assert parse_agent_message(over_the_wire(msg)) == msg
    assert parse_agent_message(json.dumps(msg.to_wire())) == msg  # the text form parses the same


@pytest.mark.parametrize("msg", SERVER_MESSAGES, ids=lambda m: m.type)
def test_every_control_plane_message_survives_the_wire_unchanged(msg: Welcome) -> None:
    assert parse_server_message(over_the_wire(msg)) == msg


def test_each_end_accepts_only_the_messages_of_its_direction() -> None:
    with pytest.raises(ControlError, match="unknown message type 'load'"):
        parse_agent_message(SERVER_MESSAGES[1].to_wire())
    with pytest.raises(ControlError, match="unknown message type 'hello'"):
        parse_server_message(AGENT_MESSAGES[0].to_wire())


def test_optional_fields_left_empty_are_omitted_on_the_wire() -> None:
    assert Unload(model_sha256=SHA, layer_start=0, layer_end=30).to_wire() == {
        "type": "unload",
        "model_sha256": SHA,
        "layer_start": 0,
        "layer_end": 30,
    }
    assert Progress(assignment_id=1, state="unloaded").to_wire() == {
        "type": "progress",
        "assignment_id": 1,
        "state": "unloaded",
        "progress": 0.0,
        "error": "",
    }


def test_a_heartbeat_without_figures_gets_zeros() -> None:
    msg = parse_agent_message({"type": "heartbeat", "telemetry": {"sessions": 2, "kv_bytes": 5}})
    assert isinstance(msg, Heartbeat)
    assert msg.telemetry.sessions == 2 and msg.telemetry.kv_budget_bytes == 0
    assert msg.telemetry.raw["kv_bytes"] == 5 and msg.telemetry.raw["tok_s"] == 0.0


def test_unknown_fields_are_dropped_so_a_newer_peer_can_add_optional_ones() -> None:
    transfer = {"done_bytes": 10, "wanted_bytes": 20, "peers": 2, "source": "swarm", "x": "y"}
    msg = parse_agent_message(
        {"type": "progress", "assignment_id": 3, "state": "fetching", "transfer": transfer, "later": 1}
    )
    assert isinstance(msg, Progress) and msg.transfer is not None
    assert msg.transfer.to_wire() == {"done_bytes": 10, "wanted_bytes": 20, "peers": 2, "source": "swarm"}


def test_a_hello_from_an_agent_that_predates_the_version_field_is_taken_as_version_1() -> None:
    msg = parse_agent_message({"type": "hello", "hardware": {"cpu_count": 2}})
    assert isinstance(msg, Hello) and msg.protocol == PROTOCOL_VERSION and msg.hardware.cpu_count == 2


def progress(**fields: object) -> dict[str, object]:
    return {"type": "progress", "assignment_id": 1, "state": "fetching", **fields}


def load(**fields: object) -> dict[str, object]:
    return {**SERVER_MESSAGES[1].to_wire(), **fields}


@pytest.mark.parametrize(
    ("msg", "error"),
    [
        ([], "JSON object"),
        ("{", "malformed JSON"),
        ({"kind": "hello"}, "needs a string 'type'"),
        ({"type": "nope"}, "unknown message type 'nope'"),
        (progress(assignment_id="1"), "assignment_id: Input should be a valid integer"),
        (progress(assignment_id=True), "assignment_id"),
        (progress(assignment_id=-1), "assignment_id"),
        (progress(state="exploded"), "state: Input should be"),
        (progress(progress=1.5), "progress"),
        (progress(transfer=[1]), "transfer"),
        (progress(transfer={"peers": -1}), "transfer.peers"),
        (progress(transfer={"source": "ftp"}), "transfer.source"),
        ({"type": "hello", "backends": "torch"}, "backends"),
        ({"type": "hello", "dataplane_url": "ftp://x"}, "dataplane_url must be an http"),
        ({"type": "hello", "protocol": 2}, "protocol 2 is not supported"),
        ({"type": "hello", "hardware": []}, "hardware"),
        ({"type": "hello", "shards": [{"model_sha256": SHA, "layer_start": 0}]}, "shards.0.layer_end"),
        (
            {"type": "hello", "shards": [{"model_sha256": SHA, "layer_start": 5, "layer_end": 5}]},
            "layer_end must be greater",
        ),
        ({"type": "hello", "shards": [{"model_sha256": "x", "layer_start": 0, "layer_end": 1}]}, "sha256"),
        ({"type": "heartbeat", "telemetry": {"sessions": True}}, "telemetry.sessions"),
        ({"type": "heartbeat", "telemetry": 5}, "telemetry"),
        ({"type": "error"}, "error: Field required"),
    ],
)
def test_malformed_agent_messages_raise_a_control_error_saying_what_is_wrong(msg: object, error: str) -> None:
    with pytest.raises(ControlError, match=error):
        parse_agent_message(msg)


@pytest.mark.parametrize(
    ("msg", "error"),
    [
        ({"type": "launch"}, "unknown message type 'launch'"),
        ({"type": "load", "assignment_id": 1}, "model_sha256: Field required"),
        (load(layer_start="0"), "layer_start"),
        (load(manifest_url="http://elsewhere.example/m"), "manifest_url"),
        (load(trackers="/t"), "trackers"),
        (load(layer_end=0), "layer_end must be greater"),
        ({"type": "unload", "model_sha256": SHA, "layer_start": 0}, "layer_end"),
        ({"type": "welcome", "node_id": "n", "heartbeat_interval_s": 0}, "heartbeat_interval_s"),
    ],
)
def test_malformed_commands_raise_a_control_error_saying_what_is_wrong(msg: object, error: str) -> None:
    with pytest.raises(ControlError, match=error):
        parse_server_message(msg)


@pytest.mark.parametrize(
    "msg",
    [
        progress(error="x" * (MAX_STR + 1)),
        {"type": "error", "error": "x" * (MAX_STR + 1)},
        {"type": "hello", "version": "v" * 101},
        {"type": "hello", "backends": ["b" * 101]},
        {"type": "hello", "backends": ["torch"] * 21},
        {"type": "hello", "dataplane_url": "http://" + "h" * 300},
        {"type": "hello", "hardware": {"hostname": "h" * 101}},
        {"type": "hello", "hardware": {"gpus": [{"name": "g"}] * 65}},
        {"type": "hello", "shards": [{"model_sha256": SHA, "layer_start": 0, "layer_end": 1}] * 1001},
        progress(transfer={"infohash": "f" * 65}),
    ],
)
def test_oversize_strings_and_lists_are_refused_not_truncated(msg: dict[str, object]) -> None:
    with pytest.raises(ControlError, match="at most"):
        parse_agent_message(msg)


def test_oversize_commands_are_refused() -> None:
    with pytest.raises(ControlError, match="at most"):
        parse_server_message(load(backend="b" * 101))
    with pytest.raises(ControlError, match="at most"):
        parse_server_message(load(web_seeds=["/w"] * 9))
    with pytest.raises(ControlError, match="larger than"):
        parse_server_message(json.dumps(load(pad="x" * MAX_MESSAGE_BYTES)))


def test_a_refusal_names_the_field_but_never_echoes_the_input_and_stays_short() -> None:
    secret = "sec_do_not_echo"
    with pytest.raises(ControlError) as e:
        parse_agent_message(progress(assignment_id=secret, error=["x"] * 50, progress=secret))
    assert secret not in str(e.value) and "assignment_id" in str(e.value)
    assert len(str(e.value)) <= MAX_STR
    assert e.value.kind == "progress"


def test_a_refused_error_report_is_marked_so_it_is_never_answered_with_another_error() -> None:
    with pytest.raises(ControlError) as e:
        parse_server_message({"type": "error", "error": 5})
    assert e.value.kind == "error"
    assert ErrorMessage.about("y" * (MAX_STR * 2)).error == "y" * MAX_STR


def test_the_close_codes_are_distinct_and_only_bad_credentials_and_removal_are_final() -> None:
    assert len({CLOSE_UNAUTHORIZED, CLOSE_REMOVED, CLOSE_REPLACED}) == 3
    assert all(4000 <= c <= 4999 for c in (CLOSE_UNAUTHORIZED, CLOSE_REMOVED, CLOSE_REPLACED))
    assert {CLOSE_UNAUTHORIZED, CLOSE_REMOVED} == FINAL_CLOSE_CODES


def view(i: int, a: int, b: int, state: str = "assigned") -> AssignmentView:
    return AssignmentView(i, SHA, a, b, state, "torch")


def shard(a: int, b: int) -> ShardRef:
    return ShardRef(model_sha256=SHA, layer_start=a, layer_end=b)


def test_reconcile_marks_held_shards_ready_and_resends_missing_loads() -> None:
    ready, commands = reconcile([view(1, 0, 15, "ready"), view(2, 15, 30, "fetching")], [shard(0, 15)])
    assert ready == [1]
    assert [(c.type, c.assignment_id) for c in commands] == [("load", 2)]
    assert isinstance(commands[0], Load) and commands[0].file_url == f"/artifacts/{SHA}/file"


def test_reconcile_unloads_shards_nobody_assigned_and_ignores_failed_ones() -> None:
    ready, commands = reconcile([view(1, 0, 15, "failed")], [shard(0, 15), shard(15, 30)])
    assert ready == []
    assert commands == [
        Unload(model_sha256=SHA, layer_start=0, layer_end=15),
        Unload(model_sha256=SHA, layer_start=15, layer_end=30),
    ]


def test_reconcile_unloads_a_draining_assignment_the_node_still_holds() -> None:
    _, commands = reconcile([view(7, 0, 30, "draining")], [shard(0, 30)])
    assert [c.to_wire() for c in commands] == [
        {"type": "unload", "assignment_id": 7, "model_sha256": SHA, "layer_start": 0, "layer_end": 30}
    ]


def test_a_load_command_the_control_plane_builds_is_one_the_agent_accepts() -> None:
    plain = load_command(view(1, 0, 15))
    assert plain.torrent_url is None and plain.trackers == [] and plain.web_seeds == []
    swarm = load_command(AssignmentView(2, SHA, 0, 15, "assigned", "native", "/tracker/k/announce", "/ws/k"))
    for cmd in (plain, swarm):
        assert parse_server_message(over_the_wire(cmd)) == cmd


def test_llamacpp_is_only_chosen_for_a_full_model_shard() -> None:
    assert choose_backend(["llamacpp", "torch"], full_model=False) == "torch"
    assert choose_backend(["llamacpp", "torch"], full_model=True) == "llamacpp"
    assert choose_backend(["native", "torch"], full_model=False, preferred="torch") == "torch"
    assert choose_backend(["native", "torch"], full_model=False, preferred="cuda") == "native"
