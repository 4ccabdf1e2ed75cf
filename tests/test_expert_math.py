"""The remote expert path must reproduce transformers' experts modules bit for bit."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe.models.expert_math import combine, expert_forward, split_by_expert
from tests.tiny_configs import TINY


def remote_equivalent(experts, hidden, top_k_index, top_k_weights, kernel):
    parts = []
    for rows in split_by_expert(top_k_index, experts.num_experts, kernel):
        y = expert_forward(
            hidden[rows.token_idx],
            experts.gate_up_proj[rows.expert],
            experts.down_proj[rows.expert],
            experts.config.hidden_act,
            kernel,
        )
        parts.append((rows, y))
    return combine(hidden, parts, top_k_weights, kernel)


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("kernel", ["eager", "grouped_mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_remote_experts_equal_transformers(family, kernel, dtype, tokens):
    torch.manual_seed(tokens)
    model = AutoModelForCausalLM.from_config(TINY[family](), dtype=dtype, experts_implementation=kernel)
    block = model.model.layers[1].mlp
    hidden = torch.randn(tokens, model.config.hidden_size).to(dtype)
    _, weights, index = block.gate(hidden)
    with torch.no_grad():
        want = block.experts(hidden, index, weights)
        got = remote_equivalent(block.experts, hidden, index, weights, kernel)
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


def test_split_by_expert_orders_rows_like_the_eager_kernel():
    index = torch.tensor([[3, 1], [1, 0], [3, 2]])
    rows = split_by_expert(index, num_experts=4)
    assert [r.expert for r in rows] == [0, 1, 2, 3]
    one = rows[1]
    # eager iterates the mask [k, T]: slot 0 before slot 1, tokens ascending within a slot
    assert one.slot_idx.tolist() == [0, 1] and one.token_idx.tolist() == [1, 0]


def test_split_by_expert_follows_grouped_mm_sort_order():
    index = torch.tensor([[3, 1], [1, 0], [3, 2]])
    _, perm = torch.sort(index.reshape(-1))
    rows = split_by_expert(index, num_experts=4, kernel="grouped_mm")
    assert [r.expert for r in rows] == [0, 1, 2, 3]
    flat = torch.cat([r.token_idx * 2 + r.slot_idx for r in rows])
    assert flat.tolist() == perm.tolist()


def test_unknown_kernel_is_an_error():
    with pytest.raises(ValueError, match="unknown experts kernel"):
        expert_forward(torch.ones(1, 2), torch.ones(4, 2), torch.ones(2, 2), "silu", "magic")
