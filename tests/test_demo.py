"""The README's first command, run as a new user runs it, prints the text the README shows.

It starts from an empty model cache (a fresh HOME), so the demo model is trained from the corpus
that ships with odmoe, with the kernels it pins, and then answered by a whole local cluster; then
`odmoe-make-model --demo` trains it again, independently, and must write the same bytes. About
three and a half minutes on two cores: marked `demo`, out of the default run; CI runs it (`-m
demo`, `make test-demo`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme_commands import shown_commands

REPO = Path(__file__).resolve().parents[1]


def readme_first_run(page: Path = REPO / "README.md") -> tuple[list[str], str]:
    """The first odmoe-launch command a page shows, and the output block that follows it."""
    text = page.read_text()
    command = next(c for c in shown_commands(page) if c[0] == "odmoe-launch")
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.S | re.M)  # (language, body)
    first = next(i for i, (lang, body) in enumerate(blocks) if lang == "bash" and "odmoe-launch" in body)
    shown = next((body for lang, body in blocks[first + 1 :] if lang == ""), None)
    assert shown, "the README shows no output after its first command"
    return command, shown


def test_the_readme_shows_a_first_command_and_its_output():
    command, shown = readme_first_run()
    assert command[:2] == ["odmoe-launch", "role=local"] and "--prompt" in command
    assert re.search(r"^-- \d+ new tokens after \d+ prompt tokens$", shown, flags=re.M)


def test_getting_started_shows_the_readme_command_and_output():
    assert readme_first_run(REPO / "docs" / "getting-started.md") == readme_first_run()


@pytest.mark.demo
def test_the_readme_first_command_prints_what_the_readme_shows(tmp_path):
    command, shown = readme_first_run()
    ends = re.match(r"(.*?)\n(-- \d+ new tokens after \d+ prompt tokens)\n", shown, flags=re.S)
    text, count = ends.groups()
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    env["HOME"] = str(tmp_path)  # an empty model cache: the demo model is trained here, now
    exe = Path(sys.executable).with_name("odmoe-launch")
    done = subprocess.run(
        [str(exe), *command[1:]], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training the demo model" in done.stderr  # it was made here, not found in a cache
    assert done.stdout.rstrip("\n") == text
    assert count in done.stderr
    # odmoe-make-model --demo trains the same model again, independently: the same bytes
    again = subprocess.run(
        [str(exe.with_name("odmoe-make-model")), "--demo", "--out", str(tmp_path / "again")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    (cached,) = (tmp_path / ".cache" / "odmoe" / "models").glob("demo-*/model.safetensors")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == cached.read_bytes()
