"""What the suites run on: the model, and prompts the trained model has never seen.

Prompts are cut from standard-library sources *outside* the trained model's training corpus (the
first 12 MB of sorted `*.py` files), starting at a `def` or `class` line, so every machine draws the
same prompts without a data set. `prompt_ids(tokenizer, i, length)` gives exactly `length` tokens.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

from odmoe.tools.corpora import _SKIP_DIRS, corpus_files
from odmoe.tools.training import TRAINED_SETTINGS

# What the trained benchmark model read, so prompts come from elsewhere (odmoe.tools.training).
TRAINING_CORPUS_BYTES = TRAINED_SETTINGS["mixtral"].corpus_bytes


@functools.lru_cache(maxsize=1)
def _unseen_sources() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    seen = set(corpus_files(TRAINING_CORPUS_BYTES))
    files = [
        str(p)
        for p in sorted(root.rglob("*.py"))
        if not _SKIP_DIRS & set(p.relative_to(root).parts[:-1]) and str(p) not in seen
    ]
    return files or sorted(seen)  # a tiny stdlib: fall back to seen sources rather than nothing


@functools.lru_cache(maxsize=256)
def prompt_text(i: int) -> str:
    """The i-th prompt: source from the first def/class line of a file, spread over the unseen files."""
    files = _unseen_sources()
    step = max(len(files) // 97, 1)  # 97 prompts before a file repeats, from all over the library
    for k in range(len(files)):
        path = files[(i * step + k) % len(files)]
        lines = Path(path).read_text(errors="replace").splitlines(keepends=True)
        for j, line in enumerate(lines):
            if line.startswith(("def ", "class ")) and len(lines) - j > 40:
                return "".join(lines[j : j + 60])
    raise RuntimeError("no standard-library source with a def or class line was found")


def prompt_ids(tokenizer, i: int, length: int) -> list[int]:
    """Exactly `length` token ids of the i-th prompt (longer sources are cut, shorter ones repeated)."""
    ids = tokenizer(prompt_text(i))["input_ids"]
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


@functools.lru_cache(maxsize=2)
def _reference_model(model_path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path).eval()


def reference_tokens(
    model_path: str, ids: list[int], new_tokens: int, sampling: dict | None = None
) -> list[int]:
    """transformers' own generate() in this process, what every cluster must reproduce: the one
    reference decode of the suites. Greedy, or `sampling` = generate()'s sampling keywords plus
    `seed` (torch.manual_seed(seed) first, as odmoe's seeded sampling promises)."""
    import torch

    kwargs = dict(sampling or {})
    seed = kwargs.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    kwargs.setdefault("do_sample", False)
    x = torch.tensor([ids])
    out = _reference_model(model_path).generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, **kwargs
    )
    return out[0, len(ids) :].tolist()
