"""What the suites run on: the model, and prompts the trained model has never seen.

Prompts are cut from standard-library sources *outside* the trained model's training corpus (the
first 12 MB of sorted `*.py` files), starting at a `def` or `class` line, so every machine draws the
same prompts without a data set. `prompt_ids(tokenizer, i, length)` gives exactly `length` tokens.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

from odmoe.model_factory import _SKIP_DIRS, corpus_files
from odmoe.training import TRAINED_SETTINGS

# What the trained benchmark model read, so prompts come from elsewhere (odmoe.training).
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


def reference_tokens(model_path: str, ids: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy generate() in this process: what every cluster must reproduce."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=new_tokens)
    return out[0, len(ids) :].tolist()
