"""Property tests of the control channel's schema: valid messages round trip, mutated text and random
JSON values are refused with ControlError, never another exception."""

from __future__ import annotations

import contextlib
import json

from hypothesis import given
from hypothesis import strategies as st

from agent.wire.control import ControlError, parse_agent_message, parse_server_message
from tests.agent._fuzz import FUZZ, mutated

SHA = "cd" * 32
AGENT_MESSAGES = [
    {
        "type": "hello",
        "version": "0.1.0",
        "backends": ["native"],
        "dataplane_url": "http://10.0.0.2:7070",
        "speed": 12.5,
        "free_memory_bytes": 1 << 30,
        "shards": [{"model_sha256": SHA, "layer_start": 0, "layer_end": 10}],
    },
    {"type": "heartbeat"},
    {"type": "error", "error": "boom"},
]
SERVER_MESSAGES = [
    {
        "type": "load",
        "assignment_id": 7,
        "model_sha256": SHA,
        "layer_start": 0,
        "layer_end": 10,
        "backend": "native",
        "manifest_url": "/models/1/manifest.json",
        "file_url": "/models/1/file",
    },
    {"type": "unload", "assignment_id": 7, "model_sha256": SHA, "layer_start": 0, "layer_end": 10},
    {"type": "drain"},
    {"type": "resync"},
]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)


def _parse_or_refuse(parse, raw: object) -> None:  # noqa: ANN001
    with contextlib.suppress(ControlError):
        parse(raw)


def test_the_sample_messages_are_valid() -> None:
    for m in AGENT_MESSAGES:
        parse_agent_message(m)
    for m in SERVER_MESSAGES:
        parse_server_message(m)


@FUZZ
@given(st.data())
def test_mutated_message_text_is_parsed_or_refused_with_a_control_error(data: st.DataObject) -> None:
    agent = data.draw(st.booleans())
    msg = data.draw(st.sampled_from(AGENT_MESSAGES if agent else SERVER_MESSAGES))
    raw = data.draw(mutated(json.dumps(msg).encode()))
    _parse_or_refuse(parse_agent_message if agent else parse_server_message, raw)


@FUZZ
@given(st.data())
def test_a_message_with_fields_replaced_by_random_json_is_parsed_or_refused(data: st.DataObject) -> None:
    agent = data.draw(st.booleans())
    msg = dict(data.draw(st.sampled_from(AGENT_MESSAGES if agent else SERVER_MESSAGES)))
    for key in data.draw(st.lists(st.sampled_from(sorted(msg)), max_size=3)):
        msg[key] = data.draw(json_values)
    msg.update(data.draw(st.dictionaries(st.text(max_size=10), json_values, max_size=2)))
    _parse_or_refuse(parse_agent_message if agent else parse_server_message, msg)


@FUZZ
@given(json_values)
def test_any_json_value_is_parsed_or_refused(value: object) -> None:
    _parse_or_refuse(parse_agent_message, value)
    _parse_or_refuse(parse_server_message, value)
