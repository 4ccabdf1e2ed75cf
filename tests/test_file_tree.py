"""docs/files.md, the annotated file tree the README points to, names every module: 25 modules that
issues 45-49 added (GGUF, the join link, the share pull, two suites, the HTTP door's bodies) had gone
unlisted unseen. A module counts as named when its file name appears in the tree; a benchmark suite
(benchmarks/suites/NAME.py) when NAME appears in the tree's `suites/` entry. Each of odmoe's
sub-packages says in its __init__ how its modules fit: that text names each of them too (34 were
left out)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.test_house_size import ROOT, sources

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

ROOMS = ("odmoe", "nodes", "launch", "benchmarks")


def modules() -> list[Path]:
    return [path.relative_to(ROOT) for path in sources(ROOMS) if path.name != "__init__.py"]


def unlisted(tree: str, paths: list[Path]) -> list[str]:
    """The paths the tree does not name (module contract)."""
    suites = re.search(r"^  suites/(.*?)^  \S", tree, re.S | re.M)
    suites_entry = suites.group(1) if suites else ""
    missing = []
    for path in paths:
        if path.parts[:2] == ("benchmarks", "suites"):
            named = re.search(rf"\b{path.stem}\b", suites_entry) or path.name in suites_entry
        else:
            named = path.name in tree
        if not named:
            missing.append(str(path))
    return missing


def test_the_check_sees_an_unlisted_module():
    tree = "  config.py   the schema\n  suites/   recall, grid\n  eval/  tasks\n"
    paths = [Path("odmoe/config.py"), Path("odmoe/new.py"), Path("benchmarks/suites/grid.py")]
    assert unlisted(tree, [*paths, Path("benchmarks/suites/cache.py")]) == [
        "odmoe/new.py",
        "benchmarks/suites/cache.py",
    ]


def test_the_file_tree_names_every_module():
    tree = (ROOT / "docs" / "files.md").read_text()
    assert unlisted(tree, modules()) == [], "docs/files.md does not list these modules"


def unnamed_in_room(package: Path) -> list[str]:
    """The modules of a sub-package its __init__'s docstring does not name (as a word)."""
    text = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return [
        path.stem
        for path in sorted(package.glob("*.py"))
        if path.name != "__init__.py" and not re.search(rf"\b{path.stem}\b", text)
    ]


def test_each_room_names_its_modules():
    rooms = [p.parent for p in sorted((ROOT / "odmoe").glob("*/__init__.py")) if p.parent.name != "rpc"]
    assert len(rooms) >= 8
    unnamed = {room.name: missing for room in rooms if (missing := unnamed_in_room(room))}
    assert unnamed == {}, "these sub-packages' __init__ docstrings leave modules out"
