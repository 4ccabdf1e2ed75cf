"""What every suite is made of, written once: its prompts, its printed table, its few statistics.

A suite (`benchmarks/suites/NAME.py`) exposes `run(cfg, model_path, out) -> dict` and reads as one
straight line:
1) prompts: `prompts(tokenizer, count)`, unseen standard-library source cut to exactly
   `PROMPT_TOKENS` tokens (or the suite's own length), the same on every machine;
2) a `Table` whose header is printed before the first cluster starts;
3) per case: run it (`cluster_runs.run_cluster` / `summarise`), keep its row, print it;
4) write: `out.write(stem, suite, report)` (results.ResultsDir: the JSON, with what ran where);
5) plot: `plots.NAME(..., out.path(stem, "png"), out.describe(new_tokens))`.
The report it returns is what it wrote. Nothing here starts a process or reads a config.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from odmoe_bench.workload import prompt_ids

PROMPT_TOKENS = 32  # a suite's prompt length where its config names none


def prompts(tokenizer, count: int, length: int = PROMPT_TOKENS, first: int = 0) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids: workload prompts `first`, `first + 1`, ..."""
    return [prompt_ids(tokenizer, first + i, length) for i in range(count)]


def fmt(x: float | None, width: int = 8, spec: str = ".3f", none: str = "-") -> str:
    """A table cell: the number, or `none` where there is none (e.g. recall without a shadow)."""
    return f"{none:>{width}}" if x is None else f"{x:{width}{spec}}"


class Table:
    """A table printed row by row while a suite runs (rows of a long sweep appear as they finish).

    Each column is "title:spec" or "title:spec:key". The spec is a format spec whose width sets the
    column: "<26" text left-aligned, ">8" text or a count right-aligned, "13.1f" a number
    right-aligned; a title takes its column's alignment. The key names the cell in a row's record
    for `record` ("decode_tokens_per_s.mean" reaches into a nested dict). A cell of None prints
    `none` ("-"), right-aligned, and a bool as its word; `sep` goes between columns.
    """

    def __init__(self, *columns: str, sep: str = "", none: str = "-"):
        self.columns = [(c.split(":") + [""])[:3] for c in columns]
        self.sep, self.none = sep, none

    def header(self, before: str = "") -> None:
        """`before`: a line break or a caption printed on the header's line, ahead of it."""
        titles = (f"{t:{'<' if spec.startswith('<') else '>'}{_width(spec)}}" for t, spec, _ in self.columns)
        print(before + self.sep.join(titles), flush=True)

    def line(self, *cells) -> str:
        return self.sep.join(
            f"{self.none:>{_width(spec)}}"
            if cell is None
            else f"{str(cell) if isinstance(cell, bool) else cell:{spec}}"
            for cell, (_, spec, _) in zip(cells, self.columns, strict=True)
        )

    def row(self, *cells) -> None:
        print(self.line(*cells), flush=True)

    def cells(self, record: dict, **given) -> list:
        """`record`'s values at the columns' keys; a value in `given` under a column's key wins."""
        return [given[key] if key in given else _at(record, key) for _, _, key in self.columns]

    def record(self, record: dict, **given) -> None:
        self.row(*self.cells(record, **given))


def _at(record: dict, key: str):
    for part in key.split("."):
        record = record.get(part) if isinstance(record, dict) else None
    return record


def _width(spec: str) -> int:
    digits = spec.lstrip("<>^").split(".")[0].rstrip("dfsge%")
    return int(digits or 0)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are there (None skipped); None when none is."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) as the sorted value at index q * n (no interpolation); None if empty."""
    if not values:
        return None
    ranked = sorted(values)
    return ranked[min(int(q * len(ranked)), len(ranked) - 1)]


def change_pct(new: float | None, base: float | None) -> float | None:
    """How much `new` is above `base`, in percent (negative: below); None where either is missing or 0."""
    return None if not new or not base else (new / base - 1) * 100


def alternated(round_: int, names: tuple[str, ...]) -> tuple[str, ...]:
    """`names` in order on even rounds, reversed on odd ones: neither side always runs first."""
    return names if round_ % 2 == 0 else tuple(reversed(names))
