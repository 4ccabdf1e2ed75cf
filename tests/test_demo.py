"""The README's first command, run as a new user runs it, prints the text the README shows.

It starts from an empty model cache (a fresh HOME), so the demo model is trained from the corpus
that ships with odmoe, with the kernels it pins, and then answered by a whole local cluster, whose
text must be what transformers' `generate` gives for those weights; then `odmoe-make-model --demo`
trains it again, independently, and must write the same bytes. The text itself is the README's on
an Intel CPU (MKL takes the kernel pin there only); an AMD EPYC with AVX-512 trained the weights
whose text docs/getting-started.md shows; another CPU's text is not known, and only that part is
skipped there. About three and a half minutes on two cores: marked `demo`, out of the default run;
CI runs it (`-m demo`, `make test-demo`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme_commands import shown_commands

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

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


AMD_AVX512 = "AMD EPYC with AVX-512"  # the paragraph of getting-started.md before its text


def expected_text(vendor: str, avx512: bool) -> str | None:
    """The text the README's command prints on this CPU: the README's on Intel, getting-started's
    on an AMD CPU with AVX-512 (MKL chooses its own code on AMD: other Zen CPUs may differ)."""
    if vendor == "GenuineIntel":
        shown = readme_first_run()[1]
    elif vendor == "AuthenticAMD" and avx512:
        shown = shown_after(REPO / "docs" / "getting-started.md", AMD_AVX512)
    else:
        return None
    return shown_text(shown)[0]


def shown_after(page: Path, words: str) -> str:
    """The first plain output block after the first line of page that contains words."""
    text = page.read_text()
    rest = text[text.index(words) :]
    return re.search(r"^```\n(.*?)^```$", rest, flags=re.S | re.M).group(1)


def shown_text(shown: str) -> tuple[str, str]:
    """An output block's generated text and its count line."""
    ends = re.match(r"(.*?)\n(-- \d+ new tokens after \d+ prompt tokens)\n", shown, flags=re.S)
    assert ends, "the block shows no '-- N new tokens after M prompt tokens' line"
    return ends.group(1), ends.group(2)


def test_the_other_cpus_text_is_shown_with_its_count_line():
    text, count = shown_text(shown_after(REPO / "docs" / "getting-started.md", AMD_AVX512))
    assert text.startswith("def fibonacci(n):") and text != shown_text(readme_first_run()[1])[0]
    assert count == shown_text(readme_first_run()[1])[1]


def test_the_text_expected_follows_the_cpu_that_trained_the_demo():
    readme = shown_text(readme_first_run()[1])[0]
    amd = shown_text(shown_after(REPO / "docs" / "getting-started.md", AMD_AVX512))[0]
    assert expected_text("GenuineIntel", avx512=True) == expected_text("GenuineIntel", False) == readme
    assert expected_text("AuthenticAMD", avx512=True) == amd
    assert expected_text("AuthenticAMD", avx512=False) is None  # another AMD branch: not recorded
    assert expected_text("arm", avx512=False) is None


def generate_text(model_dir: Path, prompt: str, new_tokens: int) -> str:
    """What one process running the model with transformers prints for the prompt (greedy)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return prompt + tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.demo
def test_the_readme_first_command_prints_what_the_readme_shows(tmp_path):
    command, shown = readme_first_run()
    _, count = shown_text(shown)
    env = {k: v for k, v in os.environ.items() if k != "XDG_CACHE_HOME"}
    env["HOME"] = str(tmp_path)  # an empty model cache: the demo model is trained here, now
    exe = Path(sys.executable).with_name("odmoe-launch")
    done = subprocess.run(
        [str(exe), *command[1:]], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training the demo model" in done.stderr  # it was made here, not found in a cache
    assert count in done.stderr
    (cached,) = (tmp_path / ".cache" / "odmoe" / "models").glob("demo-*/model.safetensors")
    prompt = command[command.index("--prompt") + 1]
    new_tokens = int(next(c for c in command if c.startswith("max_new_tokens=")).split("=")[1])
    printed = done.stdout.rstrip("\n")
    assert printed == generate_text(cached.parent, prompt, new_tokens)  # exact, whatever the weights
    # odmoe-make-model --demo trains the same model again, independently: the same bytes
    again = subprocess.run(
        [str(exe.with_name("odmoe-make-model")), "--demo", "--out", str(tmp_path / "again")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == cached.read_bytes()
    report = json.loads((cached.parent / "odmoe_training.json").read_text())
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    text = expected_text(report["cpu_vendor"], re.search(r"\bavx512f\b", flags) is not None)
    if text is None:
        pytest.skip(f"no recorded text for a {report['cpu_vendor']} CPU's demo model (printed {printed!r})")
    assert printed == text, f"{report['cpu_vendor']} CPU"
