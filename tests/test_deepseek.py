"""DeepSeek-V2 / V3: routers, MLA cache rows, checkpoints as downloaded, and real clusters.

Main keeps transformers' own DeepSeek modules (MLA attention, dense first layer, shared experts,
router) and replaces only the routed experts, so what can go wrong is what odmoe adds: loading the
router's weights and `e_score_correction_bias` into main's skeleton (in from_pretrained's dtype),
the combine of the remote experts' outputs (the router's float32, already scaled weights), the K/V
rows handed to the shadow (MLA caches the compressed latent, not per-head keys and values), and the
layers a real checkpoint holds beyond the model (V3's multi-token prediction).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DynamicCache

from odmoe import LocalCluster
from odmoe.models.checkpoint import Checkpoint
from odmoe.models.expert_math import combine, expert_forward, split_by_expert
from odmoe.models.families import UnsupportedModelError
from odmoe.models.kv_rows import newest_rows, overwrite_newest_rows
from odmoe.models.main_model import build_main_model
from odmoe.shadow.quantized_linear import fits_packed_cpu_nf4 as _fits_packed_cpu_nf4
from odmoe.shadow.shadow_model import (
    PRECISIONS,
    choice_scores,
    group_limit,
    load_shadow_model,
    router_modules,
)
from odmoe.tools.model_factory import ModelSpec, make_model
from tests.test_cluster_fidelity import PROMPTS, check_sampling, reference
from tests.tiny_configs import TINY

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

ROUTINGS = {  # name -> (family, topk_method)
    "v2-greedy": ("deepseek_v2", "greedy"),
    "v2-group_limited_greedy": ("deepseek_v2", "group_limited_greedy"),
    "v3-sigmoid-bias-groups": ("deepseek_v3", None),
}


def _save_tiny(routing: str, out: Path, ties: bool = False) -> Path:
    """A tiny DeepSeek checkpoint with decisive routers, a non-zero V3 bias and, with `ties`, exact
    ties: experts 2j and 2j+1 share router rows, and group 1 copies group 0 (8 experts, 4 groups)."""
    family, method = ROUTINGS[routing]
    config = TINY[family]()
    config.num_experts_per_tok = 3  # of the 4 experts in the 2 groups allowed: the limit binds
    if method:
        config.topk_method = method
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for _, router in router_modules(model, config.n_routed_experts):
            router.weight.normal_(0, 0.5)
            if ties:
                router.weight[1::2] = router.weight[0::2]
                router.weight[2:4] = router.weight[0:2]
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.normal_(0, 0.1)
                if ties:
                    bias = router.e_score_correction_bias
                    bias[1::2] = bias[0::2]
                    bias[2:4] = bias[0:2]
    model.save_pretrained(out)
    return out


def _moe_routers(model) -> list[torch.nn.Module]:
    return [r for _, r in router_modules(model, model.config.n_routed_experts)]


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_main_router_is_bit_identical_to_transformers(routing, dtype, ties, tmp_path):
    """Main's router (transformers' module in main's meta skeleton, filled by odmoe's loader) against
    from_pretrained's: same logits, weights and indices, bit for bit, ties and group limit included."""
    path = _save_tiny(routing, tmp_path / "m", ties=ties)
    main = build_main_model(Checkpoint(path), dtype).model
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    torch.manual_seed(1)
    hidden = torch.randn(257, ref.config.hidden_size).to(dtype)
    for got_router, want_router in zip(_moe_routers(main), _moe_routers(ref), strict=True):
        bias = getattr(want_router, "e_score_correction_bias", None)
        if bias is not None:  # from_pretrained keeps it fp32 whatever the dtype; main must too
            assert bias.dtype == torch.float32 and bias.abs().sum() > 0
            assert torch.equal(got_router.e_score_correction_bias, bias)
        with torch.no_grad():
            got, want = got_router(hidden), want_router(hidden)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w)
        logits, weights, index = want
        if ties:  # the tie really is there: partners score exactly alike
            scores = choice_scores(want_router, logits)
            assert torch.equal(scores[:, 0::2], scores[:, 1::2])
        if want_router.topk_group is not None and want_router.num_group > 1 and routing != "v2-greedy":
            groups = (index // (want_router.num_experts // want_router.num_group)).tolist()
            assert all(len(set(row)) <= want_router.topk_group for row in groups)
        factor = want_router.routed_scaling_factor
        if getattr(want_router, "norm_topk_prob", False):  # V3: normalised, then scaled
            assert torch.allclose(weights.sum(-1), torch.full((len(hidden),), factor), atol=1e-5)


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_shadow_choice_scores_rank_as_the_router_chooses(routing, tmp_path):
    """The shadow publishes the top-(k+1) of `choice_scores`; its top-k must be the router's choice,
    and the group limit must matter (else the test could not tell a limited router from a greedy one)."""
    model = AutoModelForCausalLM.from_pretrained(_save_tiny(routing, tmp_path / "m"))
    torch.manual_seed(2)
    hidden = torch.randn(500, model.config.hidden_size)
    for router in _moe_routers(model):
        with torch.no_grad():
            logits, _, index = router(hidden)
        scores = choice_scores(router, logits)
        top = scores.topk(router.top_k, dim=-1).indices
        assert torch.equal(top.sort(-1).values, index.sort(-1).values)
        greedy = logits.sigmoid() + router.e_score_correction_bias if routing.startswith("v3") else logits
        unlimited = greedy.topk(router.top_k, dim=-1).indices.sort(-1).values
        limited_differs = bool((unlimited != index.sort(-1).values).any())
        assert limited_differs == (routing != "v2-greedy")


@pytest.mark.parametrize("routing", ["v2-group_limited_greedy", "v3-sigmoid-bias-groups"])
def test_the_shadow_node_hedges_the_best_expert_of_a_near_tied_group_left_out(routing, tmp_path):
    """The shadow's router hook (odmoe/shadow/predictor.py, by odmoe/shadow/choices.py's rule)
    publishes group hedges for a group-limited router: with a margin wider than any gap, the best
    expert of the best group left out, which the router scored -inf, beside the (k+1)-th candidate."""
    from odmoe.shadow.choices import router_choice
    from odmoe.shadow.hedging import GroupLimit

    model = AutoModelForCausalLM.from_pretrained(_save_tiny(routing, tmp_path / "m"))
    router = _moe_routers(model)[0]
    num_experts = router.num_experts if hasattr(router, "num_experts") else router.n_routed_experts
    torch.manual_seed(3)
    size = num_experts // router.num_group
    for row in torch.randn(20, model.config.hidden_size):
        with torch.no_grad():
            output = router(row[None])
        choice = router_choice(router, output, 0, router.top_k, 100.0, group_limit(router))
        experts, candidates, hedges = choice.experts, choice.candidates, choice.hedges
        chosen_groups = {e // size for e in experts}
        assert candidates[router.top_k] in hedges  # the (k+1)-th: every gap is within this margin
        outside = [h for h in hedges if h // size not in chosen_groups]
        per_group = -(-router.top_k // router.topk_group)  # what a kept group gives, on average
        assert len(outside) == per_group  # the group hedges: from a group the router left out
        unmasked = (
            output[0][-1].float().sigmoid() + router.e_score_correction_bias
            if routing.startswith("v3")
            else output[0][-1].float().softmax(-1)
        )
        limit = GroupLimit(router.num_group, router.topk_group, routing.startswith("v3"))
        ranks = [
            unmasked[g * size : (g + 1) * size].topk(2).values.sum()
            if limit.by_top2
            else unmasked[g * size : (g + 1) * size].max()
            for g in range(limit.groups)
        ]
        best_out = max((g for g in range(limit.groups) if g not in chosen_groups), key=lambda g: ranks[g])
        best = unmasked[best_out * size : (best_out + 1) * size].topk(per_group).indices + best_out * size
        assert outside == best.tolist()


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
    ids=["fp32", "bf16"],
)
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_main_with_experts_computed_apart_equals_generate(family, dtype, model_dirs):
    """Main's model with the routed experts computed outside it (as workers do, from the checkpoint's
    per-expert tensors) and combined by odmoe: tokens and logits of generate() exactly."""
    ckpt = Checkpoint(model_dirs[family])
    main = build_main_model(ckpt, dtype)

    def call(layer, hidden, top_k_index, top_k_weights):
        parts = []
        for rows in split_by_expert(top_k_index, ckpt.num_experts, main.kernel):
            e = ckpt.expert(layer, rows.expert)
            y = expert_forward(
                hidden[rows.token_idx],
                e.gate_up.to(dtype),
                e.down.to(dtype),
                ckpt.config.hidden_act,
                main.kernel,
            )
            parts.append((rows, y))
        return combine(hidden, parts, top_k_weights, main.kernel)

    main.attach(call)
    assert main.moe_layers == [1, 2, 3]  # layer 0 is dense (first_k_dense_replace=1), on main
    x = torch.tensor([[5, 6, 7, 8, 100, 200, 300, 17, 19, 23, 29]])
    kwargs = dict(max_new_tokens=16, do_sample=False, output_logits=True, return_dict_in_generate=True)
    ref = AutoModelForCausalLM.from_pretrained(model_dirs[family], dtype=dtype)
    want = ref.generate(x, attention_mask=torch.ones_like(x), **kwargs)
    got = main.model.generate(x, attention_mask=torch.ones_like(x), **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(g, w) for g, w in zip(got.logits, want.logits, strict=True))


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_mla_kv_rows_are_the_whole_cache_state(family, model_dirs):
    """MLA caches per layer the normed compressed latent [1, 1, S, kv_lora_rank] as "keys" and the
    roped shared key part [1, 1, S, qk_rope_head_dim] as "values". Two caches that differ only in
    their newest position become equal when main's newest rows overwrite the shadow's, and the next
    step then gives identical logits: those two tensors are all the state K/V alignment must carry."""
    model = AutoModelForCausalLM.from_pretrained(model_dirs[family]).eval()
    cfg = model.config
    prompt = torch.tensor([[5, 9, 200, 31, 77, 12]])
    caches = []
    with torch.no_grad():
        cache = DynamicCache(config=cfg)
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        for last in (40, 41):  # main's and the shadow's newest token differ
            caches.append(copy.deepcopy(cache))
            model(input_ids=torch.tensor([[last]]), past_key_values=caches[-1], use_cache=True)
        main_cache, shadow_cache = caches
        keys, values = newest_rows(main_cache, 1)
        assert keys.shape == (len(model.model.layers), 1, 1, cfg.kv_lora_rank)
        assert values.shape == (len(model.model.layers), 1, 1, cfg.qk_rope_head_dim)
        assert not torch.equal(newest_rows(shadow_cache, 1)[0], keys)
        overwrite_newest_rows(shadow_cache, keys, values)
        for a, b in zip(main_cache.layers, shadow_cache.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        step = torch.tensor([[64]])
        want = model(input_ids=step, past_key_values=main_cache, use_cache=True).logits
        got = model(input_ids=step, past_key_values=shadow_cache, use_cache=True).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_shadow_loads_deepseek_at_every_precision(precision, model_dirs):
    model = load_shadow_model(model_dirs["deepseek_v3"], precision)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 9, 200, 31]])).logits
    assert torch.isfinite(logits.float()).all()
    routers = _moe_routers(model)
    assert [layer for layer, _ in router_modules(model, model.config.n_routed_experts)] == [1, 2, 3]
    if precision not in ("fp32", "bf16", "fp16"):  # routers and their bias stay full precision
        assert all(r.weight.dtype == torch.float32 for r in routers)
    assert all(r.e_score_correction_bias.dtype == torch.float32 for r in routers)


def test_nf4_linears_the_packed_cpu_kernel_cannot_take_keep_the_generic_path(model_dirs):
    """Regression: on a CPU with AVX512-BF16, bitsandbytes repacks nf4 weights for its own kernel on
    the first forward and crashed on the tiny DeepSeek's 32-wide LoRA inputs ("shape '[96, 0]' is
    invalid"); those linears now keep the generic nf4 path, every other one is left to bitsandbytes."""
    import bitsandbytes as bnb

    assert _fits_packed_cpu_nf4(64, 96, 64) and _fits_packed_cpu_nf4(1536, 4096, 64)
    assert not _fits_packed_cpu_nf4(32, 96, 64) and not _fits_packed_cpu_nf4(64, 48, 64)
    model = load_shadow_model(model_dirs["deepseek_v3"], "nf4")
    quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    narrow = [m for m in quantized if not _fits_packed_cpu_nf4(m.in_features, m.out_features, 64)]
    assert narrow and all(m.support_avx512bf16_for_cpu is False for m in narrow)
    fitting = [m for m in quantized if m not in narrow]
    assert all(m.support_avx512bf16_for_cpu == bnb.functional.has_avx512bf16() for m in fitting)


# -- checkpoints as downloaded -----------------------------------------------------------------


def add_mtp_layer(path: Path) -> Path:
    """Make a factory checkpoint look like DeepSeek-V3 as downloaded: `num_nextn_predict_layers: 1`
    and a multi-token-prediction layer `model.layers.{N}` (a full MoE decoder layer plus its
    enorm/hnorm/eh_proj/shared_head tensors) in a shard of its own, listed in the index."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    config = json.loads((path / "config.json").read_text())
    n = config["num_hidden_layers"]
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    last = {}
    for shard in sorted(set(index["weight_map"].values())):
        for key, tensor in load_file(path / shard).items():
            if key.startswith(f"model.layers.{n - 1}."):
                last[key.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.")] = tensor + 1.0
    gen = torch.Generator().manual_seed(7)
    extra = {
        **last,
        f"model.layers.{n}.enorm.weight": torch.ones(hidden),
        f"model.layers.{n}.hnorm.weight": torch.ones(hidden),
        f"model.layers.{n}.eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=gen),
        f"model.layers.{n}.shared_head.norm.weight": torch.ones(hidden),
        f"model.layers.{n}.shared_head.head.weight": torch.randn(vocab, hidden, generator=gen),
        f"model.layers.{n}.embed_tokens.weight": torch.randn(vocab, hidden, generator=gen),
    }
    save_file(extra, path / "model-mtp.safetensors", metadata={"format": "pt"})
    index["weight_map"].update({key: "model-mtp.safetensors" for key in extra})
    index_file.write_text(json.dumps(index, indent=2))
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


@pytest.fixture(scope="module")
def downloaded_v3(tmp_path_factory) -> str:
    spec = ModelSpec(
        family="deepseek_v3", layers=4, hidden=64, intermediate=32, experts=16, top_k=4, vocab=1024,
        max_positions=256, seed=3,
    )  # fmt: skip
    path = make_model(spec, tmp_path_factory.mktemp("downloaded") / "v3", max_shard_size="150KB")
    return str(add_mtp_layer(path))


def test_mtp_layer_is_skipped_with_a_log_line(downloaded_v3, caplog):
    shards = set(
        json.loads((Path(downloaded_v3) / "model.safetensors.index.json").read_text())["weight_map"].values()
    )
    assert len(shards) > 2  # really sharded, plus the MTP shard
    with caplog.at_level(logging.INFO, logger="odmoe.models.checkpoint"):
        ckpt = Checkpoint(downloaded_v3)
    assert "skipping layers [4]" in caplog.text and "multi-token-prediction" in caplog.text
    assert ckpt.moe_layers == [1, 2, 3]
    assert not [k for k in ckpt.non_expert_state_dict() if k.startswith("model.layers.4.")]
    main = build_main_model(ckpt, torch.float32)
    assert len(main.model.model.layers) == 4


def test_a_quantization_odmoe_does_not_serve_is_refused(tmp_path, model_dirs):
    """Block-wise FP8 is served (tests/test_fp8_checkpoint.py); others are refused by name."""
    import shutil

    path = Path(shutil.copytree(model_dirs["deepseek_v3"], tmp_path / "awq"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'awq'-quantized checkpoint is not served"):
        Checkpoint(path)


# -- real clusters: V3 in the default run, V2 and the full matrix (test_cluster_fidelity,
#    test_prefill, test_shadow_cluster) under `-m ""`

ID_PROMPTS = [[7], [(7 * i + 11) % 1000 + 4 for i in range(100)]]


def _check_cluster(path: str, overrides: list[str]) -> list[dict]:
    stats = []
    with LocalCluster(path, workers=2, group_size=2, overrides=overrides) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=24)
        assert got.token_ids == reference(path, PROMPTS[0], new_tokens=24)[0]
        stats.append(got.stats)
        for ids in ID_PROMPTS:  # a 1-token and a 100-token prompt through batched prefill
            got = cluster.client.generate(ids, max_new_tokens=4)
            assert got.token_ids == reference(path, ids, new_tokens=4)[0], f"{len(ids)}-token prompt"
            stats.append(got.stats)
        check_sampling(path, cluster)
    return stats


@pytest.mark.integration
@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_downloaded_v3_is_served_exactly_with_a_quantized_shadow(downloaded_v3, reap_children):
    """The sharded checkpoint with its MTP layer, as is: int8 shadow aligned every iteration, a
    third of its predictions made wrong, prefill in mini-batches."""
    overrides = [
        "lab=on",
        "shadow.precision=int8_dynamic",
        "alignment.token_period=1",
        "alignment.kv_period=1",
        "emulation.inject_wrong=0.3",
        "prefill.mini_batch=8",
    ]
    stats = _check_cluster(downloaded_v3, overrides)
    assert stats[0]["shadow"] is True and 0 < stats[0]["recall"]["overall"] < 1
    assert set(stats[1]["prefill"]["experts_per_layer"].values()) == {4}  # 1 token: exactly top-4


@pytest.mark.slow  # ~80 s here: the default run keeps one DeepSeek cluster (V3, above)
@pytest.mark.integration
def test_v2_is_served_exactly_with_a_free_running_bf16_shadow(model_dirs, reap_children):
    overrides = [
        "lab=on",
        "shadow.precision=bf16",
        "alignment.token_period=2",
        "alignment.kv_period=0",
        "emulation.inject_wrong=0.3",
        "prefill.mini_batch=3",
        "prefill.placement=balanced",
    ]
    stats = _check_cluster(model_dirs["deepseek_v2"], overrides)
    assert stats[0]["shadow"] is True and stats[0]["recall"]["activated"] > 0


@pytest.mark.extended  # a DeepSeek cluster takes 1-2 min here: CI runs it within its budget
@pytest.mark.integration
def test_a_lost_worker_changes_no_deepseek_token(model_dirs, reap_children):
    """Worker 1 killed at decode iteration 6: its layers' experts go to worker 0 from then on."""
    path = model_dirs["deepseek_v3"]
    want, _ = reference(path, PROMPTS[0], new_tokens=16)
    words = ["lab=on", "preset=paper", "fault.node=worker1", "fault.iteration=6"]
    with LocalCluster(path, workers=2, group_size=2, overrides=words) as cluster:
        got = cluster.client.generate(PROMPTS[0], max_new_tokens=16)
    assert got.token_ids == want and got.stats["failover"]["live_workers"] == [0]
