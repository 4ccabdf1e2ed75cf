"""Build the offline evaluation tasks' data (`benchmarks/eval/data/*.jsonl`) from Python sources.

    python -m odmoe_bench.eval.make_tasks            # rebuilds both files, deterministically

Two tasks for lm-evaluation-harness (`benchmarks/eval/tasks/*.yaml`), both cut from standard-library
sources the trained benchmark model never saw (`benchmarks/workload.py`), so they run offline:
- `odmoe_code_mc` (multiple choice, scored by log-likelihood): 8 lines of code, then four candidate
  next lines, the real one among three lines drawn from other files;
- `odmoe_code_gen` (generation): the same 8 lines and the first half of the next line, and the rest of
  that line to write (exact match, greedy, until the end of the line).
The files are committed, so every machine evaluates the same documents whatever Python it runs;
this script says how they were made.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from odmoe_bench.workload import _unseen_sources

DATA = Path(__file__).parent / "data"
CONTEXT_LINES = 8
DOCS = 200


def _snippets(rng: random.Random) -> list[tuple[str, str]]:
    """(context, next line) pairs: 8 non-blank lines of code and the non-blank line after them."""
    out = []
    files = _unseen_sources()
    for path in rng.sample(files, min(len(files), 4 * DOCS)):
        lines = [x for x in Path(path).read_text(errors="replace").splitlines() if x.strip()]
        lines = [x for x in lines if len(x) < 100 and not x.lstrip().startswith("#")]
        if len(lines) < CONTEXT_LINES + 2:
            continue
        start = rng.randrange(len(lines) - CONTEXT_LINES - 1)
        context = "\n".join(lines[start : start + CONTEXT_LINES]) + "\n"
        target = lines[start + CONTEXT_LINES]
        if len(target.strip()) >= 4:
            out.append((context, target))
        if len(out) == DOCS:
            break
    return out


def _halves(line: str) -> tuple[str, str]:
    """The line cut in the middle of its code (its indentation stays with the first half)."""
    indent = len(line) - len(line.lstrip())
    cut = indent + (len(line) - indent) // 2
    return line[:cut], line[cut:]


def build(seed: int = 0) -> None:
    rng = random.Random(seed)
    snippets = _snippets(rng)
    DATA.mkdir(parents=True, exist_ok=True)
    with (DATA / "code_mc.jsonl").open("w") as out:
        for i, (context, target) in enumerate(snippets):
            others = [t for j, (_, t) in enumerate(snippets) if j != i and t != target]
            choices = [target, *rng.sample(others, 3)]
            rng.shuffle(choices)
            out.write(
                json.dumps({"context": context, "choices": choices, "gold": choices.index(target)}) + "\n"
            )
    with (DATA / "code_gen.jsonl").open("w") as out:
        for context, target in snippets:
            head, rest = _halves(target)
            out.write(json.dumps({"context": context + head, "target": rest}) + "\n")
    print(f"wrote {len(snippets)} documents to {DATA}/code_mc.jsonl and code_gen.jsonl")


if __name__ == "__main__":
    build()
