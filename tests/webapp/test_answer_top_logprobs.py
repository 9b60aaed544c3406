"""The top alternatives of a logits row (webapp/routing/answer.py top_logprobs) from a row a broken or
lying last hop sent: shorter than the alternatives asked for, or empty, it gives what it has
(docs/security.md, "A token outside the vocabulary")."""

from __future__ import annotations

import math

import numpy as np
import pytest

from webapp.routing.answer import top_logprobs


def test_the_top_alternatives_are_the_most_likely_first_with_their_log_softmax() -> None:
    top = top_logprobs(np.array([0.0, 2.0, 1.0], dtype=np.float32), 2)
    assert [t for t, _ in top] == [1, 2]
    z = math.log(math.exp(0.0) + math.exp(2.0) + math.exp(1.0))
    assert top[0][1] == pytest.approx(2.0 - z, abs=1e-6) and top[1][1] == pytest.approx(1.0 - z, abs=1e-6)


def test_a_row_shorter_than_the_alternatives_asked_for_gives_what_it_has_and_an_empty_one_none() -> None:
    assert [t for t, _ in top_logprobs(np.array([3.0, 1.0], dtype=np.float32), 5)] == [0, 1]
    assert top_logprobs(np.array([], dtype=np.float32), 3) == ()
