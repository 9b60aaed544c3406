"""Parsing OpenAI request bodies: every parameter's accepted forms, and refusals in OpenAI's error shape."""

from __future__ import annotations

from typing import Any

import pytest

from webapp.api.params import ApiError, parse_body, parse_chat, parse_completion

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def chat(**kw: Any) -> Any:
    return parse_chat({**CHAT, **kw})


def refused(fn: Any, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(body)
    return e.value


def test_a_minimal_chat_request_samples_at_openais_default_temperature_unstreamed_and_unbounded() -> None:
    r = parse_chat(CHAT)
    assert (r.kind, r.model, r.stream, r.max_tokens, r.stop, r.logprobs) == (
        "chat",
        "m",
        False,
        None,
        (),
        False,
    )
    assert r.messages == [{"role": "user", "content": "hi"}]
    assert r.sampling.temperature == 1.0 and r.sampling.top_p == 1.0


def test_sampling_parameters_reach_the_sampler_and_a_seed_is_kept_exactly() -> None:
    r = chat(temperature=0.7, top_p=0.9, seed=1234, top_k=40)
    assert (r.sampling.temperature, r.sampling.top_p, r.sampling.seed, r.sampling.top_k) == (
        0.7,
        0.9,
        1234,
        40,
    )
    assert chat(seed=-1).sampling.seed == 2**64 - 1  # OpenAI seeds are signed; the wire's are u64


def test_unseeded_sampling_draws_a_fresh_seed_and_greedy_needs_none() -> None:
    seeds = {chat(temperature=0.8).sampling.seed for _ in range(4)}
    assert len(seeds) > 1
    assert chat(temperature=0).sampling.seed == 0


def test_max_completion_tokens_is_an_alias_and_the_smaller_of_the_two_wins() -> None:
    assert chat(max_completion_tokens=7).max_tokens == 7
    assert chat(max_tokens=9, max_completion_tokens=7).max_tokens == 7
    assert chat(max_tokens=5).max_tokens == 5


def test_stop_takes_a_string_or_a_list_of_up_to_four() -> None:
    assert chat(stop="\n").stop == ("\n",)
    assert chat(stop=["a", "bc"]).stop == ("a", "bc")
    assert refused(parse_chat, {**CHAT, "stop": ["a"] * 5}).param == "stop"
    assert refused(parse_chat, {**CHAT, "stop": [""]}).param == "stop"
    assert refused(parse_chat, {**CHAT, "stop": 3}).param == "stop"


def test_stream_options_include_usage_needs_stream() -> None:
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage
    assert refused(parse_chat, {**CHAT, "stream_options": {"include_usage": True}}).param == "stream_options"


def test_messages_accept_the_three_roles_developer_and_text_parts() -> None:
    r = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok"},
        ]
    )
    assert [m["role"] for m in r.messages] == ["system", "user", "assistant"]
    assert r.messages[1]["content"] == "ab"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": CHAT["messages"]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        ({**CHAT, "n": 2}, "n"),
        ({**CHAT, "temperature": 3}, "temperature"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "top_p": 1.5}, "top_p"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "max_tokens": 2.5}, "max_tokens"),
        ({**CHAT, "seed": True}, "seed"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({**CHAT, "response_format": {"type": "json_object"}}, "response_format"),
        ({**CHAT, "logit_bias": {"1": 5}}, "logit_bias"),
        ({**CHAT, "presence_penalty": 0.5}, "presence_penalty"),
        ({**CHAT, "top_logprobs": 3}, "top_logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_chat_parameters_are_refused_with_400_naming_the_parameter(
    body: dict[str, Any], param: str
) -> None:
    e = refused(parse_chat, body)
    assert e.status == 400 and e.param == param
    err = e.body()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"]


def test_n_equal_to_one_and_zero_penalties_are_accepted() -> None:
    assert chat(n=1, presence_penalty=0, frequency_penalty=0.0, user="u1").model == "m"


def test_chat_logprobs_with_top_logprobs() -> None:
    r = chat(logprobs=True, top_logprobs=5)
    assert r.logprobs and r.top_logprobs == 5
    assert chat(logprobs=True).top_logprobs == 0


def test_a_completion_prompt_is_a_string_one_string_in_a_list_or_token_ids() -> None:
    assert parse_completion({"model": "m", "prompt": "Once"}).prompt == "Once"
    assert parse_completion({"model": "m", "prompt": ["Once"]}).prompt == "Once"
    assert parse_completion({"model": "m", "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    r = parse_completion({"model": "m", "prompt": "x", "logprobs": 2})
    assert r.logprobs and r.top_logprobs == 2 and r.kind == "completion"
    assert parse_completion({"model": "m", "prompt": "x", "logprobs": 0}).logprobs


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
        ({"model": "m", "prompt": [1, -2]}, "prompt"),
        ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
        ({"model": "m", "prompt": "x", "suffix": "y"}, "suffix"),
    ],
)
def test_bad_completion_parameters_are_refused_with_400(body: dict[str, Any], param: str) -> None:
    e = refused(parse_completion, body)
    assert e.status == 400 and e.param == param


@pytest.mark.parametrize("raw", [b"", b"{", b"[1]", b"\xff"])
def test_a_body_that_is_not_a_json_object_is_a_400(raw: bytes) -> None:
    with pytest.raises(ApiError) as e:
        parse_body(raw)
    assert e.value.status == 400 and e.value.code == "invalid_json"
