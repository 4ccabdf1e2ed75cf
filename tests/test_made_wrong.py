"""The shadow made wrong on purpose (emulation.inject_wrong*, odmoe/shadow/made_wrong.py): off, it
changes nothing; at rate 1 every prediction and every own token is another."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from odmoe.shadow.made_wrong import MadeWrong

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def made(wrong: float, wrong_token: float, seed: int = 0) -> MadeWrong:
    emulation = SimpleNamespace(inject_wrong=wrong, inject_wrong_token=wrong_token)
    return MadeWrong(emulation, 8, 100, random.Random(seed))


@given(
    st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), st.integers(0, 99), st.integers(0, 99)
)
def test_off_changes_nothing_and_at_one_everything(experts, token, seed):
    off = made(0.0, 0.0, seed)
    assert off.experts(experts) == experts and off.token(token) == token
    on = made(1.0, 1.0, seed)
    assert not set(on.experts(experts)) & set(experts)
    assert on.token(token) != token and 0 <= on.token(token) < 100
