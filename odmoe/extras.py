"""Optional dependencies: a command that needs one says which extra to install, not a traceback.

    require("matplotlib", "bench", "odmoe-bench")  # raises MissingExtra if matplotlib is absent

The extras (pyproject's [project.optional-dependencies]): `bench` (matplotlib: odmoe-bench's
figures), `compression` (lz4, zipnn: the compression suite's baselines, which it skips without
them), `dev` (bench + the test and lint tools). The command-line entries catch MissingExtra, print
its message and exit with code 2 (bad input: the installation, not the program, is what is wrong).
"""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import `module`, or raise MissingExtra: "<what> needs <module>: pip install 'odmoe[<extra>]'"."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        top = module.partition(".")[0]
        if exc.name is not None and exc.name.partition(".")[0] != top:
            raise  # the module is there but one of *its* imports failed: that traceback is the news
        raise MissingExtra(f"{what} needs {top}: pip install 'odmoe[{extra}]'") from exc
