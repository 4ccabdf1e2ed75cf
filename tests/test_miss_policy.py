"""The pure parts of the lossy miss policies: buddy lists (CFT, cap), the TAE gate, the importance
gate, the per-token budget."""

from __future__ import annotations

import math

import numpy as np
import pytest

from odmoe.lossy.miss_policy import (
    MissConfig,
    Profile,
    TokenBudget,
    buddy_lists,
    choose_substitutes,
    conditional_coactivation,
    importance_band,
    token_activating_entropy,
)

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

# Expert 0 co-activates with 1 (6 times), 2 (3), 3 (1); expert 3 never with anyone but 0.
M = np.array(
    [
        [9, 6, 3, 1],
        [6, 9, 0, 0],
        [3, 0, 9, 0],
        [1, 0, 0, 9],
    ]
)


def test_conditional_coactivation_rows_sum_to_one_and_ignore_the_diagonal():
    q = conditional_coactivation(M)
    assert q[0].tolist() == pytest.approx([0, 0.6, 0.3, 0.1])
    assert q[3].tolist() == [1.0, 0, 0, 0]
    assert conditional_coactivation(np.eye(2) * 5).sum() == 0  # never co-activated: no peers


@pytest.mark.parametrize(
    ("alpha", "k_max", "expected"),
    [
        (0.5, 4, [1]),  # 0.6 >= 0.5 after one
        (0.6, 4, [1]),  # reached exactly
        (0.85, 4, [1, 2]),
        (1.0, 4, [1, 2, 3]),
        (1.0, 2, [1, 2]),  # capped at K_max
        (0.01, 4, [1]),  # at least one
    ],
)
def test_buddy_lists_cover_alpha_capped_at_k_max(alpha, k_max, expected):
    lists = buddy_lists(M, alpha, k_max)
    assert lists[0] == expected
    assert lists[3] == [0]
    assert buddy_lists(np.eye(2), 1.0, 4) == [[], []]  # no co-activation, no buddies


def test_token_activating_entropy():
    assert token_activating_entropy([0.5, 0.5]) == pytest.approx(1.0)
    assert token_activating_entropy([1.0, 0.0]) == 0.0
    assert token_activating_entropy([0.9]) == 0.0
    p = [0.7, 0.3]
    assert token_activating_entropy(p) == pytest.approx(
        -(0.7 * math.log(0.7) + 0.3 * math.log(0.3)) / math.log(2)
    )
    assert token_activating_entropy([7, 3]) == pytest.approx(token_activating_entropy(p))  # renormalised


BUDDY = MissConfig(policy="buddy", budget=2)
BUDDIES = buddy_lists(M, 0.85, 4)  # 0: [1, 2], 1: [0], 2: [0], 3: [0]


def test_buddy_substitutes_a_resident_buddy_only_when_tae_allows():
    flat, peaky = [0.5, 0.5], [0.95, 0.05]
    args = dict(missing=[0], activated=[0, 3], resident=[2, 1], budget_left=2, buddies=BUDDIES)
    assert choose_substitutes(BUDDY, weights=flat, tau=0.5, **args) == {0: 1}  # best buddy first
    assert choose_substitutes(BUDDY, weights=peaky, tau=0.5, **args) == {}  # TAE <= tau: reload
    # a resident that is no buddy of the missing expert is never used
    assert choose_substitutes(BUDDY, [3], [3, 1], flat, [2], 2, tau=0.0, buddies=BUDDIES) == {}
    # reload is never lossy
    assert choose_substitutes(MissConfig(), weights=flat, tau=0.0, **args) == {}


def test_each_resident_stands_in_once_and_the_budget_caps():
    flat = [0.5, 0.5]
    both = dict(missing=[1, 2], activated=[1, 2], weights=flat, buddies=BUDDIES, tau=0.0)
    assert choose_substitutes(BUDDY, resident=[0], budget_left=2, **both) == {1: 0}  # 0 used once
    assert choose_substitutes(BUDDY, resident=[0, 3], budget_left=0, **both) == {}


def test_importance_replaces_only_low_score_experts_with_similar_ones():
    # token's top-2: expert 0 (0.50) and 1 (0.21); beta = 3rd score = 0.20
    scores = [0.50, 0.21, 0.20, 0.05, 0.04]
    low_below, beta, alt = importance_band(scores, 2, 0.3)
    assert (low_below, beta, alt) == pytest.approx((0.26, 0.20, 0.14))
    s = MissConfig(policy="importance", budget=2, importance_alpha=0.3)
    kw = dict(activated=[0, 1], weights=[0.7, 0.3], budget_left=2, scores=scores)
    assert choose_substitutes(s, missing=[1], resident=[2, 3], **kw) == {1: 2}
    assert choose_substitutes(s, missing=[0], resident=[2, 3], **kw) == {}  # a top-score expert: reload
    assert choose_substitutes(s, missing=[1], resident=[3], **kw) == {}  # 0.05 < 0.14: not similar
    zero = MissConfig(policy="importance", importance_alpha=0.0)
    assert choose_substitutes(zero, missing=[1], resident=[2], **kw) == {}  # alpha 0: lossless


def test_token_budget_counts_per_token():
    budget = TokenBudget(2)
    budget.spend(0)
    budget.spend(0)
    budget.spend(1)
    assert (budget.left(0), budget.left(1), budget.left(5)) == (0, 1, 2)
    budget.reset()
    assert budget.left(0) == 2


def test_profile_tau_is_the_layer_percentile():
    profile = Profile(coactivation={0: M}, tae_percentiles={0: np.linspace(0.0, 1.0, 101)})
    assert profile.tau(0, 20) == pytest.approx(0.2)
    assert profile.tau(0, 12.5) == pytest.approx(0.125)
    assert profile.buddies(0.85, 4)[0] == BUDDIES


def test_settings_validate():
    MissConfig(policy="buddy").validate()
    for bad in (dict(policy="skip"), dict(alpha=0.0), dict(budget=-1), dict(tae_percentile=150.0)):
        with pytest.raises(ValueError):
            MissConfig(**bad).validate()
