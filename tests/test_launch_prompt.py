"""odmoe-launch takes any prompt text through --prompt / --prompt-file / --prompt -, outside Hydra's
override grammar, and answers an unparsable `prompt=...` with a hint instead of Hydra's error."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from odmoe.launch.cli import PromptArgumentError, take_prompt, unparsable_prompt

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

LAUNCH = [sys.executable, "-m", "odmoe.launch.cli"]
AWKWARD = 'def main(argv=None):\n    """Say \'héllo\' → 世界, a=b, [1, 2]."""\n    return {"x": (1,)}\n'


def test_prompt_options_are_taken_out_of_the_command_line(tmp_path, monkeypatch):
    words = ["role=local", "--prompt", AWKWARD, "max_new_tokens=4"]
    assert take_prompt(words) == (AWKWARD, ["role=local", "max_new_tokens=4"])
    assert take_prompt(["--prompt=a=b(c)", "x=1"]) == ("a=b(c)", ["x=1"])
    (tmp_path / "p.py").write_text(AWKWARD, encoding="utf-8")
    assert take_prompt(["--prompt-file", str(tmp_path / "p.py")]) == (AWKWARD, [])
    monkeypatch.setattr(sys, "stdin", io.StringIO(AWKWARD))
    assert take_prompt(["--prompt", "-"]) == (AWKWARD, [])
    assert take_prompt(["role=local", "prompt=hello"]) == (None, ["role=local", "prompt=hello"])


@pytest.mark.parametrize(
    "words, message",
    [
        (["--prompt"], "needs a value"),
        (["--prompt", "a", "--prompt", "b"], "once"),
        (["--prompt-file", "/nope"], "/nope"),
    ],
)
def test_bad_prompt_options(words, message):
    with pytest.raises(PromptArgumentError, match=message):
        take_prompt(words)


def test_only_unparsable_prompt_overrides_are_flagged():
    assert unparsable_prompt(["prompt=def main():"]) == "prompt=def main():"
    assert unparsable_prompt(["prompt=Hello world", "prompt='def f(x):'", "max_new_tokens=3"]) is None


@pytest.mark.integration  # runs the command
def test_an_unparsable_prompt_override_points_at_the_option(reap_children):
    proc = subprocess.run(
        [*LAUNCH, "role=local", "prompt=def main():"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "--prompt 'def main():'" in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr


@pytest.mark.integration
@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_any_prompt_text_reaches_the_model_unchanged(model_dirs, reap_children):
    """A real odmoe-launch: the prompt (parentheses, quotes, `=`, newlines, unicode) is echoed as it
    was given, then the continuation follows."""
    proc = subprocess.run(
        [
            *LAUNCH,
            "role=local",
            f"model.path={model_dirs['mixtral']}",
            "max_new_tokens=4",
            "--prompt",
            AWKWARD,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(AWKWARD) and len(proc.stdout) > len(AWKWARD)
    assert "-- 4 new tokens" in proc.stderr
