"""Where a suite's figures go: one JSON per run (with what was measured on what), and its PNGs.

Every JSON carries `meta`: the suite, the model, the emulated link (on or off), the cluster's shape,
the machine and the odmoe commit, so a figure read later says what it is.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

from odmoe_bench.config import BenchConfig

RESULTS = Path(__file__).parent / "results"  # where the committed figures live (the scripts' default)


class ResultsDir:
    def __init__(self, cfg: BenchConfig, model_path: str):
        self.cfg, self.model_path = cfg, model_path
        self.root = Path(cfg.results_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.suffix = f"-{_slug(cfg.name)}" if cfg.name else ""

    def path(self, stem: str, ext: str) -> Path:
        return self.root / f"{stem}{self.suffix}.{ext}"

    def meta(self, suite: str) -> dict:
        return {
            "suite": suite,
            "model": self.model_path,
            "emulated_link": asdict(self.cfg.link) if self.link_on else None,
            "cluster": asdict(self.cfg.cluster),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
            "commit": _commit(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }

    @property
    def link_on(self) -> bool:
        return self.cfg.link.bandwidth_gbps > 0 or self.cfg.link.latency_ms > 0

    def describe(self, new_tokens: int, shadow: str | None = None) -> str:
        """One line saying what a figure was measured on: cluster shape, shadow, link, tokens.
        `shadow`: what to say of the shadow where a suite varies its precision (default: the config's)."""
        c, link = self.cfg.cluster, self.cfg.link
        on = f"{link.bandwidth_gbps:g} Gbit/s + {link.latency_ms:g} ms emulated load link"
        return (
            f"{c.workers} workers in groups of {c.group_size}, {shadow or c.shadow_precision + ' shadow'}, "
            f"{on if self.link_on else 'no emulated link'}, {new_tokens} new tokens"
        )

    def write(self, stem: str, suite: str, data: dict, meta: dict | None = None) -> Path:
        """`meta`: what a suite ran where it is not `bench.model` / `bench.cluster` / `bench.link`
        (suite memory makes its own checkpoints and cluster shape)."""
        out = self.path(stem, "json")
        out.write_text(
            json.dumps({"meta": {**self.meta(suite), **(meta or {})}, **data}, indent=2, default=_plain)
        )
        print(f"wrote {out}", flush=True)
        return out


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", text).strip("_")[:120]


def _plain(value):
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_report(path: str | Path, report: dict) -> Path:
    """A standalone benchmark script's JSON (not a suite's: no ResultsDir), folders made, path said."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}", flush=True)
    return out
