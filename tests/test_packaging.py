"""Every installed command starts, and one whose optional dependency is missing names the extra."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from odmoe.extras import MissingExtra, require

ROOT = Path(__file__).parents[1]
# odmoe's commands and odmoe-bench's (benchmarks/: a distribution of its own, installed beside odmoe)
SCRIPTS = {
    name: entry
    for pyproject in (ROOT / "pyproject.toml", ROOT / "benchmarks" / "pyproject.toml")
    for name, entry in tomllib.loads(pyproject.read_text())["project"]["scripts"].items()
}


def _run_entry(entry: str, args: list[str], block: str | None = None) -> subprocess.CompletedProcess:
    """Call a [project.scripts] entry point as its console script would (argv[0] = the command),
    in a fresh interpreter; `block` makes that module impossible to import, as if not installed."""
    module, func = entry.split(":")
    code = (
        "import sys\n"
        + (f"sys.modules[{block!r}] = None\n" if block else "")
        + f"sys.argv = {args!r}\n"
        + f"from {module} import {func}\n"
        + f"sys.exit({func}())\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_every_command_answers_help(name):
    proc = _run_entry(SCRIPTS[name], [name, "--help"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()


def test_bench_without_matplotlib_names_the_extra(tmp_path):
    proc = _run_entry(
        SCRIPTS["odmoe-bench"],
        ["odmoe-bench", "suite=recall", "model=tiny", f"results_dir={tmp_path}"],
        "matplotlib",
    )
    assert proc.returncode == 2
    assert "odmoe-bench needs matplotlib: pip install 'odmoe[bench]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_require(monkeypatch):
    assert require("json", "none", "this test").dumps([]) == "[]"
    # both: an earlier test in the same run may have imported matplotlib.pyplot already
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    with pytest.raises(MissingExtra, match=r"^plots needs matplotlib: pip install 'odmoe\[bench\]'$"):
        require("matplotlib.pyplot", "bench", "plots")
