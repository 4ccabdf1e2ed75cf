"""Choosing each new token exactly as transformers' `generate()` does.

Contract: `TokenChooser(model, params, prompt_ids)` is made once per request; `choose(logits)` takes
the last position's fp32 logits (`[1, vocab]`) and returns the next token id. The tokens equal a
single-process `torch.manual_seed(seed); model.generate(do_sample=..., <params>)` because:
- the generation config is built by transformers itself (`_prepare_generation_config`): request
  parameters first, then the checkpoint's `generation_config.json`, then transformers' global
  defaults (e.g. `top_k=50` when sampling), so an unset parameter means what it means to `generate`;
- the logits processors are transformers' own list for that config (`_get_logits_processor`), run
  on the same `input_ids` (prompt + new tokens, for the repetition penalty) in the same order;
- a sampled token is one `torch.multinomial(softmax(scores), 1)` draw per step, from the request's
  own CPU generator seeded with `seed`: a fresh `torch.Generator().manual_seed(s)` yields the same
  stream as the global one after `torch.manual_seed(s)`, and no other request's draws touch it.
Greedy (`do_sample=False`) runs the same processors and takes the argmax, as `generate` does.

These are private transformers methods; the version is pinned (<6) and tests compare against
`generate()` for every family, so a change in them fails loudly instead of drifting.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict, dataclass

import torch
from transformers import PreTrainedModel

MAX_SEED = 2**63 - 1


class InvalidSampling(ValueError):
    """A sampling parameter out of range: the client's to fix."""


@dataclass(frozen=True)
class SamplingParams:
    """`None` means: whatever `generate()` would use (the checkpoint's generation config, then
    transformers' defaults)."""

    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None  # sampling without one draws a fresh seed (reported in the stats)

    def validate(self) -> None:
        checks = [
            (self.temperature, lambda v: v > 0, "temperature must be > 0 when sampling (0 means greedy)"),
            (self.top_p, lambda v: 0 < v <= 1, "top_p must lie in (0, 1]"),
            (self.top_k, lambda v: v >= 0, "top_k must be >= 0 (0 disables it)"),
            (self.min_p, lambda v: 0 <= v <= 1, "min_p must lie in [0, 1]"),
            (self.repetition_penalty, lambda v: v > 0, "repetition_penalty must be > 0"),
            (self.seed, lambda v: 0 <= v <= MAX_SEED, f"seed must lie in [0, {MAX_SEED}]"),
        ]
        for value, ok, message in checks:
            if value is not None and not ok(value):
                raise InvalidSampling(f"{message}, got {value}")

    def generate_kwargs(self) -> dict:
        """The keyword arguments of the `model.generate()` call these parameters stand for."""
        return {k: v for k, v in asdict(self).items() if v is not None and k != "seed"}


class TokenChooser:
    def __init__(self, model: PreTrainedModel, params: SamplingParams, prompt_ids: list[int]):
        params.validate()
        self.seed = params.seed if params.seed is not None else secrets.randbelow(MAX_SEED)
        config, _ = model._prepare_generation_config(None, **params.generate_kwargs())
        model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device="cpu")
        self.ids = torch.tensor([prompt_ids], dtype=torch.long)
        self.processors = model._get_logits_processor(
            generation_config=config,
            input_ids_seq_length=len(prompt_ids),
            encoder_input_ids=self.ids,
            device="cpu",
            model_kwargs={"attention_mask": torch.ones_like(self.ids)},
        )
        self.sampling = bool(config.do_sample)
        self.generator = torch.Generator().manual_seed(self.seed) if self.sampling else None

    def choose(self, logits: torch.Tensor) -> int:
        scores = self.processors(self.ids, logits)
        if self.sampling:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs, num_samples=1, generator=self.generator)[0, 0])
        else:
            token = int(torch.argmax(scores, dim=-1)[0])
        self.ids = torch.cat([self.ids, torch.tensor([[token]])], dim=-1)
        return token

    def replace_last(self, token: int) -> None:
        """A resumed request replays the token a lost main chose (normally the same one)."""
        self.ids[0, -1] = token
