"""Where the training text comes from: the running interpreter's standard-library sources, in a
fixed order, and the same sources without comments and docstrings. The demo corpus
(odmoe.tools.demo_corpus) is built from these; odmoe.tools.model_factory and odmoe.tools.training
read them. This module imports neither.
"""

from __future__ import annotations

import ast
import sysconfig
import warnings
from pathlib import Path

# Left out of the corpus: tests, vendored or generated tables that would dominate the merges.
_SKIP_DIRS = {
    "test",
    "tests",
    "site-packages",
    "encodings",
    "idlelib",
    "lib2to3",
    "pydoc_data",
    "__pycache__",
}


def corpus_files(max_bytes: int = 2_000_000) -> list[str]:
    """Standard-library sources every Python install has, in a fixed order, up to max_bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS & set(path.relative_to(root).parts[:-1]):
            continue
        files.append(str(path))
        total += path.stat().st_size
        if total >= max_bytes:
            break
    return files


def code_only(source: str) -> str:
    """The source without comments and docstrings, as `ast.unparse` writes it (4-space indents, one
    quoting style). Half of the standard library's bytes are prose; a model with two minutes of
    training spends them better on code. A file that does not parse is left out (empty string)."""
    try:
        with warnings.catch_warnings():  # old escapes in string literals: not our concern here
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return ""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    node.body = node.body[1:] or [ast.Pass()]
    try:
        return ast.unparse(tree) + "\n"
    except RecursionError:
        return ""
