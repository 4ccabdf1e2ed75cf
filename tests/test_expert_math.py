"""The remote expert path must reproduce transformers' experts modules bit for bit."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from odmoe.models.expert_math import combine, expert_forward, split_by_expert
from tests.tiny_configs import TINY

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


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


def _llama4_block(dtype, hidden, intermediate, experts, top_k):
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    torch.manual_seed(hidden + experts + top_k)
    config = Llama4TextConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
    )
    block = Llama4TextMoe(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
        block.router.weight.mul_(8)  # decisive choices, as a trained router's
    return block.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 128, 8, 1), (64, 128, 8, 2), (96, 160, 16, 3)])
def test_the_bmm_kernel_equals_llama4s_moe_block(dtype, shape):
    """Llama 4's experts as main and a worker compute them (the routed rows scaled by the router,
    each expert at its tokens' positions of the reference's bmm, on one thread; combined over every
    expert) equal Llama4TextMoe's own, bit for bit, with the reference on two threads. Computing a
    batch-of-one bmm on two threads instead differed here (AMD EPYC, fp32, 7 rows)."""
    from odmoe.models.expert_math import ExpertMLP, expert_input

    block = _llama4_block(dtype, *shape)
    mlp, experts = ExpertMLP("silu", "llama4"), block.num_experts
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for tokens in (1, 3, 7, 16, 37, 129):
            hidden = torch.randn(tokens, block.hidden_dim).to(dtype)
            with torch.no_grad():
                want, _ = block(hidden)
                scores, logits = block.router(hidden)
                top_k_index = torch.topk(logits, block.top_k, dim=1).indices
                top_k_weights = scores.gather(1, top_k_index)
                parts = []
                for rows in split_by_expert(top_k_index, experts, "bmm"):
                    x = expert_input(hidden, rows, top_k_weights, "bmm")
                    e = rows.expert
                    gate_up, down = block.experts.gate_up_proj[e], block.experts.down_proj[e]
                    positions = rows.token_idx.tolist()
                    y = expert_forward(x, gate_up, down, mlp, "bmm", (tokens, experts), positions)
                    parts.append((rows, y))
                got = block.shared_expert(hidden)
                got.add_(combine(hidden, parts, top_k_weights, "bmm", experts))
            assert torch.equal(got, want), (tokens, (got - want).abs().max())
    finally:
        torch.set_num_threads(before)


def test_row_positions_a_worker_refuses():
    """An untrusted peer's bmm positions: one distinct position per row, inside the reference's rows."""
    from odmoe.transport.messages import positions_problem

    def problem(kernel="bmm", shape=(8, 4), positions=(0, 3, 7), rows=3):
        return positions_problem(kernel, list(shape), list(positions), rows)

    assert problem() == ""
    assert "bmm kernel" in problem(kernel="eager")
    assert "bmm kernel" in problem(shape=())
    assert "3 row positions for 2 rows" in problem(rows=2)
    assert "row positions for 3 rows" in problem(positions=(1, 1, 2))
    assert "outside" in problem(positions=(0, 3, 8))
    assert "outside" in problem(positions=(0, -1, 2))
    assert "outside" in problem(positions=(0, 1.0, 2))
