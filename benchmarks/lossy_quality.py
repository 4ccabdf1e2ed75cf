"""Perplexity of a lossy miss policy, by teacher forcing held-out text in this process.

Not through the cluster (its gRPC API returns only the last position's logits), but with the same
decisions: the same `Substituter` (gates, buddy lists, per-token budget) on the same inputs. For a
text window of T tokens:
1. the shadow's predictions: the shadow model at the suite's precision runs over the window once,
   teacher forced, and its routers' top-k per position are what it would publish (its own K/V, main's
   tokens: the cluster's `alignment.token_period=1, kv_period=0`); then each predicted expert is made
   wrong with probability `inject_wrong`, by the shadow node's own rule (`odmoe/shadow/made_wrong.py`,
   applied by `nodes/shadow.py`'s ShadowLab).
2. main's forward over the window at full precision: a pre-hook on each experts module rewrites the
   top-k ids of every position past the prompt (decode positions) where the policy substitutes — a
   missing expert's slot then names the resident stand-in, computed with the missing one's gate
   weight, exactly what the cluster's main asks its worker for.
3. cross-entropy of the next token over the decode positions: perplexity = exp(mean).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from odmoe.lossy.miss_policy import MissConfig
from odmoe.lossy.substitution import Substituter
from odmoe.models.main_model import experts_modules
from odmoe.shadow.router_tap import RouterTap, wrong_experts

Predictions = dict[int, torch.Tensor]  # layer -> [T, k] expert ids


@torch.inference_mode()
def shadow_predictions(shadow: PreTrainedModel, ids: list[int], num_experts: int) -> Predictions:
    tap = RouterTap(shadow, num_experts)
    try:
        x = torch.tensor([ids])
        shadow(input_ids=x, attention_mask=torch.ones_like(x))
    finally:
        tap.close()
    return {layer: chosen.clone() for layer, chosen in tap.chosen.items()}


def inject_wrong(predicted: Predictions, rate: float, num_experts: int, seed: int) -> Predictions:
    """Each predicted expert replaced, with probability `rate`, by one the row does not hold."""
    if rate <= 0:
        return predicted
    rng = random.Random(seed)
    out = {}
    for layer, rows in sorted(predicted.items()):
        new = rows.clone()
        for t in range(rows.shape[0]):  # the shadow node's own rule (odmoe.shadow.router_tap)
            new[t] = torch.tensor(wrong_experts(rows[t].tolist(), rate, num_experts, rng))
        out[layer] = new
    return out


@dataclass
class WindowResult:
    nll_sum: float
    scored: int  # decode positions scored
    substitutions: int
    misses: int  # activated experts not predicted, over decode positions
    activated: int


@torch.inference_mode()
def score_window(
    model: PreTrainedModel,
    ids: list[int],
    prompt_tokens: int,
    predicted: Predictions,
    cfg: MissConfig,
    model_path: str,
    num_experts: int,
) -> WindowResult:
    """Teacher-forced NLL of `ids` past the prompt with `cfg`'s substitutions applied."""
    substituter = Substituter.for_model(cfg, model_path, model, num_experts) if cfg.lossy else None
    counts = {"subs": 0, "misses": 0, "activated": 0}

    def rewrite(layer: int):
        def hook(_module, args):
            hidden, top_k_index, top_k_weights = args
            new = top_k_index.clone()
            for t in range(prompt_tokens, top_k_index.shape[0]):
                activated, guess = top_k_index[t].tolist(), predicted[layer][t].tolist()
                counts["misses"] += sum(e not in guess for e in activated)
                counts["activated"] += len(activated)
                if substituter is None:
                    continue
                chosen = substituter.decide_row(layer, activated, top_k_weights[t].tolist(), guess, row=t)
                for slot, e in enumerate(activated):
                    if e in chosen:
                        new[t, slot] = chosen[e]
                counts["subs"] += len(chosen)
            return hidden, new, top_k_weights

        return hook

    handles = [m.register_forward_pre_hook(rewrite(layer)) for layer, m in experts_modules(model)]
    try:
        x = torch.tensor([ids])
        logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0].float()  # [T, V]
    finally:
        for h in handles:
            h.remove()
        if substituter is not None and substituter.tap is not None:
            substituter.tap.close()
    # position t's logits predict token t+1; score the decode positions (t >= prompt_tokens)
    target = torch.tensor(ids[prompt_tokens + 1 :])
    nll = F.cross_entropy(logits[prompt_tokens:-1], target, reduction="sum").item()
    return WindowResult(nll, len(target), counts["subs"], counts["misses"], counts["activated"])


def perplexity(results: list[WindowResult]) -> float:
    return math.exp(sum(r.nll_sum for r in results) / max(sum(r.scored for r in results), 1))
