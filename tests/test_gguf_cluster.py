"""Real clusters (main, shadow, workers as processes) serving GGUF files (issue 46) against
transformers' own GGUF loading in one process: greedy tokens and final logits, seeded sampling and
logprobs equal to the bit; the workers move each expert's blocks as stored; a lost worker, the
expert cache, a sharded file."""

from __future__ import annotations

import pytest
import torch

from odmoe import LocalCluster
from odmoe.models.gguf_checkpoint import GgufCheckpoint
from odmoe.models.open_model import load_tokenizer
from tests.test_cluster_fidelity import node_threads
from tests.test_gguf_checkpoint import reference_model

pytest.importorskip("gguf")
pytestmark = pytest.mark.integration

PROMPT = "def fibonacci(n):"
SAMPLING = [(3, {"temperature": 0.9, "top_p": 0.85, "top_k": 12})]


def generate_reference(path: str, new_tokens: int, seed: int | None = None, **params):
    """(tokens, final logits, each new token's logprob) of transformers' generate() on the file."""
    model, tokenizer = reference_model(path), load_tokenizer(path)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    if seed is not None:
        torch.manual_seed(seed)
    with node_threads(), torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=seed is not None,
            max_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            **params,
        )
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [
        float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.logits, tokens, strict=True)
    ]
    return tokens, out.logits[-1][0].float(), logprobs


def check_cluster(cluster: LocalCluster, path: str, new_tokens: int = 16) -> dict:
    want_ids, want_logits, want_logprobs = generate_reference(path, new_tokens)
    got = cluster.client.generate(PROMPT, max_new_tokens=new_tokens, return_logits=True, logprobs=0)
    assert got.token_ids == want_ids and torch.equal(got.final_logits, want_logits)
    assert got.logprobs == want_logprobs
    for seed, params in SAMPLING:
        sampled = cluster.client.generate(
            PROMPT, max_new_tokens=new_tokens, do_sample=True, seed=seed, **params
        )
        assert sampled.token_ids == generate_reference(path, new_tokens, seed, **params)[0], (seed, params)
    return got.stats


def test_a_cacheless_cluster_serves_q4_k_m_exactly_moving_the_stored_blocks(gguf_file, reap_children):
    """The paper's cacheless workers: every expert a token uses is loaded, as the file stores it."""
    path = gguf_file("qwen3_moe", "Q4_K_M")
    words = ["preset=paper", "shadow.precision=bf16", "prefill.mini_batch=3"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        stats = check_cluster(cluster, path)
    checkpoint = GgufCheckpoint(path)
    stored = {checkpoint.quantized_expert(layer, 0).nbytes for layer in checkpoint.moe_layers}
    per_expert = stats["bytes_loaded"] / stats["experts_loaded"]
    assert min(stored) <= per_expert <= max(stored)  # Q4_K_M: Q6_K down in some layers, Q4_K in others
    assert per_expert < 0.35 * checkpoint.expert_bytes(torch.bfloat16)


@pytest.mark.extended
@pytest.mark.parametrize("qtype, shards", [("Q8_0", 1), ("Q4_K", 2)])
def test_qwen2_moe_with_the_cache_and_a_shadow_in_int8(gguf_file, qtype, shards, reap_children):
    """odmoe's defaults (the workers' expert cache, a speculative shadow) on a Qwen2-MoE file."""
    path = gguf_file("qwen2_moe", qtype, shards)
    want = gguf_file("qwen2_moe", qtype)  # a sharded set holds the one file's bytes: its reference
    with LocalCluster(path, workers=2, group_size=2, overrides=["shadow.precision=int8_dynamic"]) as cluster:
        if shards == 1:
            check_cluster(cluster, path)
        else:
            got = cluster.client.generate(PROMPT, max_new_tokens=16, return_logits=True)
            want_ids, want_logits, _ = generate_reference(want, 16)
            assert got.token_ids == want_ids and torch.equal(got.final_logits, want_logits)


@pytest.mark.extended
def test_a_lost_worker_changes_no_gguf_token(gguf_file, reap_children):
    path = gguf_file("qwen3_moe", "Q4_K_M")
    want, _, _ = generate_reference(path, 24)
    words = ["lab=on", "preset=paper", "fault.node=worker1", "fault.iteration=6"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        got = cluster.client.generate(PROMPT, max_new_tokens=24)
    assert got.token_ids == want and got.stats["failover"]["live_workers"] == [0]
