"""Recall without the clock: main's greedy trajectory, and shadows re-played against it in lockstep.

Recall as the paper defines it (Eq. 2-3) counts every prediction whenever it arrived, so it depends
only on what the shadow computes, never on when. `reference_trajectory` runs the checkpoint greedily
exactly as main does (the cluster is bit-identical to it; the recall suite cross-checks that) and
records per decode iteration: the input token, main's newest K/V rows (what KV alignment would send),
each MoE layer's activated experts, and the two baseline predictors' guesses. `replay_shadow` then
runs a shadow model with an alignment schedule the way the shadow node does (same model loader, same
`AlignmentSchedule`, same `overwrite_newest_rows`) and returns its prediction for every
(iteration, layer). One trajectory serves every precision x alignment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from odmoe.main.alignment import AlignmentSchedule
from odmoe.models.cache_argument import with_cache
from odmoe.models.kv_rows import newest_rows, overwrite_newest_rows
from odmoe.shadow.router_tap import RouterTap
from odmoe.shadow.shadow_model import load_shadow_model, router_modules
from odmoe_bench.predictors import FrequencyPredictor, next_layer_gate

Position = tuple[int, int]  # (decode iteration, layer)


@dataclass
class Trajectory:
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # main's new tokens; tokens[n-1] is iteration n's input
    kv_rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # n -> rows of n-1
    activated: dict[Position, list[int]] = field(default_factory=dict)
    next_layer_gate: dict[Position, list[int]] = field(default_factory=dict)
    frequency: dict[Position, list[int]] = field(default_factory=dict)

    @property
    def iterations(self) -> int:
        return len(self.tokens) - 1  # decode iterations 1..N-1 (iteration 0 is the prefill)


@torch.inference_mode()
def reference_trajectory(
    model, prompt_ids: list[int], new_tokens: int, num_experts: int, top_k: int, eos_ids: set[int]
) -> Trajectory:
    """Greedy decoding as main does it (DynamicCache, logits_to_keep=1, stop at EOS)."""
    traj = Trajectory(list(prompt_ids))
    routers = RouterTap(model, num_experts)
    layers = model.model.layers
    entering: dict[int, torch.Tensor] = {}  # layer -> residual stream entering it (last position)
    pre = [
        layers[i].register_forward_pre_hook(_capture_input(entering, i), with_kwargs=True)
        for i in range(len(layers))
    ]
    frequency = FrequencyPredictor(top_k)
    moe_layers = [layer for layer, _ in router_modules(model, num_experts)]
    try:
        cache = DynamicCache(config=model.config)
        step = torch.tensor([prompt_ids])
        for iteration in range(new_tokens):
            if iteration >= 1:
                for layer in moe_layers:
                    traj.frequency[(iteration, layer)] = frequency.predict(layer)
            mask = torch.ones(1, len(prompt_ids) + iteration, dtype=torch.long)
            cached = with_cache(model, cache)
            out = model(input_ids=step, attention_mask=mask, **cached, use_cache=True, logits_to_keep=1)
            logits = out.logits
            for layer, index in routers.chosen.items():
                for row in index.tolist():
                    frequency.observe(layer, row)
                if iteration >= 1:
                    traj.activated[(iteration, layer)] = sorted(index[-1].tolist())
                    traj.next_layer_gate[(iteration, layer)] = next_layer_gate(layers[layer], entering[layer])
            token = int(logits[0, -1].argmax())
            traj.tokens.append(token)
            if token in eos_ids or iteration + 1 == new_tokens:
                break
            traj.kv_rows[iteration + 1] = newest_rows(cache, step.shape[1])
            step = torch.tensor([[token]])
    finally:
        routers.close()
        for h in pre:
            h.remove()
    return traj


def _capture_input(store: dict[int, torch.Tensor], layer: int):
    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        store[layer] = hidden[0, -1].detach().clone()

    return hook


@torch.inference_mode()
def replay_shadow(
    shadow,
    traj: Trajectory,
    schedule: AlignmentSchedule,
    num_experts: int,
    scores: dict | None = None,
    top_k: int = 0,
) -> dict[Position, list[int]]:
    """What a shadow node with this model and schedule predicts for each decode (iteration, layer).
    With `scores` (a dict) and `top_k`, it also gets each position's top-(k+1) (candidates, scores),
    and for a group-limited router every expert's unmasked score and the limit (what the shadow
    node publishes: `odmoe.shadow.router_tap.rank`)."""
    routers = RouterTap(shadow, num_experts, rank_top_k=top_k if scores is not None else 0)
    predicted: dict[Position, list[int]] = {}
    device = next(shadow.parameters()).device
    try:
        cache = DynamicCache(config=shadow.config)
        ids = torch.tensor([traj.prompt_ids], device=device)
        own = int(
            shadow(input_ids=ids, **with_cache(shadow, cache), use_cache=True, logits_to_keep=1)
            .logits[0, -1]
            .argmax()
        )
        for iteration in range(1, traj.iterations + 1):
            token = own
            if schedule.align_token(iteration):
                token = traj.tokens[iteration - 1]
            if schedule.align_kv(iteration):
                overwrite_newest_rows(cache, *traj.kv_rows[iteration])
            logits = shadow(
                input_ids=torch.tensor([[token]], device=device),
                **with_cache(shadow, cache),
                use_cache=True,
                logits_to_keep=1,
            ).logits
            own = int(logits[0, -1].argmax())
            for layer, index in routers.chosen.items():
                predicted[(iteration, layer)] = sorted(index[-1].tolist())
                if scores is not None:
                    ranked = routers.ranked[layer]
                    scores[(iteration, layer)] = (ranked.candidates, ranked.probs, ranked.every, ranked.limit)
    finally:
        routers.close()
    return predicted


def load_reference(path: str):
    return AutoModelForCausalLM.from_pretrained(path).eval()


def load_shadow(path: str, precision: str):
    return load_shadow_model(path, precision, "cpu")
