"""lm-evaluation-harness's `local-completions`, summing log-likelihoods as its `hf` backend does.

Contract: importing this module registers the lm-eval model `odmoe-completions`: the harness's
own `local-completions` (the same requests, retries, tokenization and parsing), except that a
continuation's log-likelihood is the sum of its token logprobs taken *in float32 on a tensor*,
which is how the harness's `hf` backend (transformers in one process) sums the very same values.
`python -m odmoe.serving.lm_eval_backend ARGS` is lm-eval's command line with it registered:

    python -m odmoe.serving.lm_eval_backend --model odmoe-completions \
        --model_args base_url=https://HOST:8000/v1/completions,model=NAME,tokenizer=PATH,... \
        --tasks TASKS

Why: odmoe's token logprobs equal transformers' to the bit, so `--model local-completions` gives
the same scores as `--model hf`; but local-completions adds the returned logprobs as Python floats
(float64) while hf adds them in float32, so a choice's reported log-likelihood may differ in its
last bits (≤ 1.7e-05 measured on 794 of 800 choices) although every term is equal. With this backend
the per-sample log-likelihoods are hf's, bit for bit. Needs the `eval` extra (lm-eval).
"""

from __future__ import annotations

from operator import itemgetter

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.openai_completions import LocalCompletionsAPI

NAME = "odmoe-completions"


def float32_sum(values: list[float]) -> float:
    """The sum of float32 logprobs as the harness's hf backend takes it (`float(tensor.sum())`)."""
    return float(torch.tensor(values, dtype=torch.float32).sum())


@register_model(NAME)
class OdmoeCompletions(LocalCompletionsAPI):
    @staticmethod
    def parse_logprobs(
        outputs: dict | list[dict],
        tokens: list[list[int]] | None = None,
        ctxlens: list[int] | None = None,
        **kwargs,
    ) -> list[tuple[float, bool]]:
        # local-completions' own parse (its is-greedy flags, its checks), then each sum redone
        parsed = LocalCompletionsAPI.parse_logprobs(outputs, tokens=tokens, ctxlens=ctxlens, **kwargs)
        sums = []
        for out in outputs if isinstance(outputs, list) else [outputs]:
            for choice, ctxlen in zip(
                sorted(out["choices"], key=itemgetter("index")), ctxlens or [], strict=False
            ):
                sums.append(float32_sum(choice["logprobs"]["token_logprobs"][ctxlen:-1]))
        return [(total, greedy) for total, (_, greedy) in zip(sums, parsed, strict=True)]


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
