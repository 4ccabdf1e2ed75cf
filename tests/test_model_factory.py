import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from odmoe.models.checkpoint import Checkpoint
from odmoe.tools.model_factory import (
    CHAT_TEMPLATE,
    CHAT_TEMPLATE_FILE,
    ModelSpec,
    ensure_default_model,
    make_model,
)
from tests.conftest import FAMILY_NAMES

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def digest(d: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(d.glob("*.safetensors")))).hexdigest()


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_each_family_loads_offline_and_generates(family, model_dirs):
    model = AutoModelForCausalLM.from_pretrained(model_dirs[family])
    tok = AutoTokenizer.from_pretrained(model_dirs[family])
    ids = tok("def f(x):", return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4 or tok.eos_token_id in out[0].tolist()
    assert tok.decode(ids[0]) == "def f(x):"


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    small = dict(family="mixtral", layers=2, hidden=32, intermediate=32, experts=4, vocab=300)
    a = make_model(ModelSpec(**small), tmp_path / "a")
    b = make_model(ModelSpec(**small), tmp_path / "b")
    c = make_model(ModelSpec(**small, seed=1), tmp_path / "c")
    assert digest(a) == digest(b) != digest(c)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_sharded_checkpoint_has_an_index_and_loads_per_expert(tmp_path):
    out = make_model(
        ModelSpec(family="qwen3_moe", layers=2, hidden=32, intermediate=32, experts=4, vocab=300),
        tmp_path / "m",
        max_shard_size="20KB",
    )
    assert (out / "model.safetensors.index.json").is_file()
    ckpt = Checkpoint(out)
    full = AutoModelForCausalLM.from_pretrained(out)
    want = full.model.layers[1].mlp.experts
    got = ckpt.expert(1, 3)
    assert torch.equal(got.gate_up, want.gate_up_proj[3]) and torch.equal(got.down, want.down_proj[3])


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"family": "llama"}, "not one of"),
        ({"top_k": 9}, "exceeds"),
        ({"heads": 3}, "divisible"),
        ({"dtype": "int8"}, "dtype"),
        ({"vocab": 100}, "too small"),
        ({"family": "deepseek_v3", "experts": 8, "top_k": 5}, "expert groups"),
    ],
)
def test_spec_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        ModelSpec(**kwargs)


def test_default_model_is_made_once(tmp_path):
    spec = ModelSpec(layers=1, hidden=32, intermediate=32, experts=4, vocab=300)
    first = ensure_default_model(tmp_path, spec)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_model(tmp_path, spec) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.extended  # beyond the default run's ~15 min: what a default test covers in its core
def test_cli_writes_a_model_and_rejects_bad_options(tmp_path):
    run = [
        sys.executable,
        "-m",
        "odmoe.launch.make_model",
        "--family",
        "olmoe",
        "--layers",
        "1",
        "--hidden",
        "32",
        "--intermediate",
        "32",
        "--experts",
        "4",
        "--vocab",
        "300",
    ]
    ok = subprocess.run([*run, "--out", str(tmp_path / "m")], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and str(tmp_path / "m") in ok.stdout
    bad = subprocess.run([*run, "--top-k", "5", "--out", str(tmp_path / "x")], capture_output=True, text=True)
    assert bad.returncode == 2 and "exceeds" in bad.stderr


def test_saved_tokenizer_has_a_chat_template_that_round_trips(model_dirs):
    tok = AutoTokenizer.from_pretrained(model_dirs["mixtral"])
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": 'def f(x="a, b"):  # ünïcode → ok'},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        '<|system|>\nYou write Python.</s>\n<|user|>\ndef f(x="a, b"):  # ünïcode → ok</s>\n<|assistant|>\n'
    )
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == tok(text)["input_ids"] and ids.count(tok.eos_token_id) == 2  # </s> is the EOS token
    assert tok.decode(ids) == text
    no_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert text == no_prompt + "<|assistant|>\n"


def test_a_cached_model_without_a_template_gets_one_and_keeps_its_weights(tmp_path):
    spec = ModelSpec(layers=1, hidden=32, intermediate=32, experts=4, vocab=300)
    made = ensure_default_model(tmp_path, spec)
    (made / CHAT_TEMPLATE_FILE).unlink()  # as saved before the template existed
    before = digest(made)
    assert ensure_default_model(tmp_path, spec) == made
    assert AutoTokenizer.from_pretrained(made).chat_template == CHAT_TEMPLATE
    assert digest(made) == before
