"""Every command the README shows is checked here, so the README cannot go stale silently.

- `odmoe-launch` lines compose and validate exactly as odmoe-launch does (the same Hydra config and
  `to_config`), with the README's own words (`--prompt` taken off the way odmoe-launch does);
- `odmoe-keys` runs for real, into a temporary directory;
- `odmoe-chat`'s options exist in its argument parser;
- every installed command (pyproject's scripts) has a row in "Which install each command needs",
  and docs/getting-started.md's copy of that table is the same;
- `pip install` lines name the constraints file and extras that exist;
- `python -m pytest` is this run; `mkdocs` lines are CI's `mkdocs build --strict` (.ci/run).
A command of any other program fails the test until a check for it is added.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import pytest
import torch

from odmoe.launch.cli import take_prompt
from odmoe.launch.settings import compose

REPO = Path(__file__).resolve().parents[1]


def shown_commands(page: Path) -> list[list[str]]:
    """A page's ```bash blocks as commands: continuation lines joined, comments dropped, `a && b`
    split into two."""
    text = page.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words:
                cut = words.index("&&") if "&&" in words else len(words)
                commands.append(words[:cut])
                words = words[cut + 1 :]
    return commands


COMMANDS = shown_commands(REPO / "README.md")
# The docs pages show many more commands, of other programs too (ssh, curl, ray); the odmoe-launch
# and odmoe-bench lines among them are checked the same way.
DOCS_COMMANDS = [c for page in sorted((REPO / "docs").rglob("*.md")) for c in shown_commands(page)]
CHECKED = ("pip", "odmoe-launch", "odmoe-keys", "odmoe-chat", "python", "mkdocs")


def test_the_readme_shows_commands_and_each_is_of_a_program_checked_here():
    assert {c[0] for c in COMMANDS} >= {"pip", "odmoe-launch", "python"}
    assert [c for c in COMMANDS if c[0] not in CHECKED] == []


def one_job(words: list[str]) -> list[str]:
    """A command's overrides as one job: `-m` dropped and a sweep's `key=a,b,c` taken at `a` (each
    value of a sweep composes alike); `$HOME` expanded as the shell would; a `--prompt-file FILE`
    (a file of the user's) dropped."""
    out, skip = [], False
    for word in words:
        if skip or word in ("-m", "--prompt-file"):
            skip = word == "--prompt-file"
            continue
        key, eq, value = os.path.expandvars(word).partition("=")
        if eq and not value.startswith(("[", "{", '"')):
            value = value.split(",")[0]
        out.append(key + eq + value)
    return out


@pytest.mark.parametrize(
    "words", [c for c in COMMANDS + DOCS_COMMANDS if c[0] == "odmoe-launch"], ids=" ".join
)
def test_every_odmoe_launch_line_composes_and_validates(words):
    _prompt, overrides = take_prompt(one_job(words[1:]))
    if any(w.endswith("device=cuda") for w in overrides) and not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):  # everything before the device checked
            compose(overrides)
        return
    compose(overrides)  # raises on an unknown key, a bad value or a combination validate() refuses


@pytest.mark.parametrize("words", [c for c in DOCS_COMMANDS if c[0] == "odmoe-bench"], ids=" ".join)
def test_every_odmoe_bench_line_of_the_docs_composes_and_validates(words):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    from odmoe_bench.cli import to_bench_config  # registers the bench schema

    overrides = one_job(words[1:])
    with initialize_config_module("odmoe_bench.conf", version_base="1.3"):
        to_bench_config(hydra_compose("bench", overrides=overrides))


def test_the_odmoe_keys_lines_run(tmp_path):
    lines = [c for c in COMMANDS if c[0] == "odmoe-keys"]
    assert lines
    for i, words in enumerate(lines):
        # the README's key directory (~/odmoe-keys) becomes a fresh one here
        args = [str(tmp_path / f"keys{i}") if w.startswith("~") else w for w in words[1:]]
        done = subprocess.run(["odmoe-keys", *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / f"keys{i}" / "token").exists()


def test_the_odmoe_chat_lines_use_options_it_has():
    lines = [c for c in COMMANDS if c[0] == "odmoe-chat"]
    helptext = subprocess.run(["odmoe-chat", "--help"], capture_output=True, text=True, timeout=60).stdout
    for words in lines:
        assert [w for w in words if w.startswith("--") and w not in helptext] == []


def test_the_pip_lines_name_files_and_extras_that_exist():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for words in (c for c in COMMANDS if c[0] == "pip"):
        if "-c" in words:
            assert (REPO / words[words.index("-c") + 1]).exists()
        for spec in (w for w in words if w.startswith(".[")):
            assert set(spec[2:-1].split(",")) <= set(extras), spec


def _install_table(page: Path) -> str:
    text = page.read_text()
    start = text.index("| command | what it is | extra |")
    return text[start : text.index("\n\n", start)]


def test_every_installed_command_is_in_the_install_table_and_its_copy_matches():
    """A console script the README's "Which install each command needs" leaves out is a command a
    reader cannot find (odmoe-chat and odmoe-profile were); docs/getting-started.md's copy of the
    table is the README's with the docs/ links made relative (it had lost four rows)."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    table = _install_table(REPO / "README.md")
    assert [s for s in scripts if f"| `{s}" not in table] == []
    assert _install_table(REPO / "docs" / "getting-started.md") == table.replace("](docs/", "](")
