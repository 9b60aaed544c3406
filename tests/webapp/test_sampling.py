"""The one sampling validator (webapp/routing/sampling.py): the API and the playground accept the same
ranges and refuse a bad value in the same words."""

from __future__ import annotations

from typing import Any

import pytest

from webapp.api.params import ApiError, parse_chat
from webapp.playground.chat import ChatRequestError, parse_chat_request
from webapp.routing.sampling import LIMITS, ParamError, number, parse_sampling

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def api_refusal(name: str, value: Any) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_chat({**CHAT, name: value})
    return e.value


def playground_refusal(name: str, value: Any) -> str:
    with pytest.raises(ChatRequestError) as e:
        parse_chat_request({"model": 1, "message": "hi", name: value})
    return str(e.value)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", 2.5),
        ("temperature", -0.1),
        ("temperature", "hot"),
        ("top_p", 1.5),
        ("top_k", 1001),
        ("top_k", 2.5),
        ("min_p", 1.1),
        ("repeat_penalty", 0.4),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("seed", True),
        ("max_tokens", 0),
    ],
)
def test_the_api_and_the_playground_refuse_a_bad_value_in_the_same_words(name: str, value: Any) -> None:
    api = api_refusal(name, value)
    assert api.status == 400 and api.param == name
    assert playground_refusal(name, value) == api.message


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**31, 2**63, 2**64 - 1])
def test_any_signed_or_unsigned_64_bit_seed_reaches_the_wire_as_unsigned(seed: int) -> None:
    api = parse_chat({**CHAT, "seed": seed}).sampling.seed
    page = parse_chat_request({"model": 1, "message": "hi", "seed": str(seed)}).sampling.seed
    assert api == page == seed % 2**64


def test_the_limits_are_openais_ranges() -> None:
    assert (LIMITS["temperature"].lo, LIMITS["temperature"].hi) == (0, 2)
    assert (LIMITS["top_p"].lo, LIMITS["top_p"].hi) == (0, 1)
    assert parse_sampling({"temperature": 2, "top_p": 1}).temperature == 2.0


def test_top_p_zero_is_greedy_and_only_the_form_reads_strings() -> None:
    s = parse_sampling({"temperature": 0.9, "top_p": 0, "seed": 7})
    assert (s.temperature, s.top_p, s.seed) == (0.0, 1.0, 7)
    assert parse_sampling({"temperature": "0.5", "seed": " 3 "}, form=True).temperature == 0.5
    with pytest.raises(ParamError) as e:
        parse_sampling({"temperature": "0.5"})
    assert e.value.code == "invalid_type" and e.value.param == "temperature"
    assert number({"max_tokens": ""}, "max_tokens", form=True) is None
