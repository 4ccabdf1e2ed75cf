"""GGUF files as published (issue 46): odmoe's small Qwen2-MoE / Qwen3-MoE models written as llama.cpp
lays a GGUF out (odmoe.tools.gguf_export), read by odmoe (odmoe.models.gguf_checkpoint) against
transformers' own GGUF loading of the same file (`from_pretrained(dir, gguf_file=...)`): every
dequantization to the bit, main's tensors and every expert as a worker loads it, the config and the
tokenizer, requests in process; and the refusals, each one line before a tensor is read."""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from odmoe.models import gguf_blocks
from odmoe.models.checkpoint import CheckpointError
from odmoe.models.families import UnsupportedModelError
from odmoe.models.gguf_blocks import dequantize, dequantize_into
from odmoe.models.gguf_checkpoint import GgufCheckpoint, gguf_location
from odmoe.models.open_model import load_tokenizer, open_checkpoint
from odmoe.tools.gguf_export import GGUF_TYPES, write_gguf
from odmoe.tools.model_factory import ModelSpec, make_model
from odmoe.worker.expert_store import ExpertStore
from tests.conftest import GGUF_SPEC as SPEC

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure

gguf = pytest.importorskip("gguf")


# every type in the default run is checked by its dequantization alone (test_blocks_...); these go
# through whole files in the default run, every type x family in -m extended
DEFAULT_TYPES = {("qwen3_moe", "Q4_K_M"), ("qwen2_moe", "Q4_K")}


@functools.cache
def reference_model(path: str, dtype: torch.dtype | None = None):
    """transformers' own GGUF loading of `path`, with the config odmoe reads from it (transformers
    5.24's GGUF config leaves the experts' width at the class default: GgufCheckpoint's docstring)."""
    directory, name = gguf_location(path)
    config = GgufCheckpoint(path).config
    kwargs = {"dtype": dtype} if dtype else {}
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, config=config, **kwargs).eval()


def _params(family_types):
    return [
        pytest.param(f, t, marks=() if (f, t) in DEFAULT_TYPES else pytest.mark.extended, id=f"{f}-{t}")
        for f, t in family_types
    ]


# -- the dequantization ----------------------------------------------------------------------------
# the types odmoe-make-model writes, and some more the package dequantizes (IQ, ternary)
DEQUANTIZABLE = [
    gguf.GGMLQuantizationType[name]
    for name in (*(t for t in GGUF_TYPES if t != "Q4_K_M"), "IQ2_XXS", "IQ3_S", "IQ1_M", "TQ2_0")
]


@pytest.mark.parametrize("kind", DEQUANTIZABLE, ids=lambda t: t.name)
def test_blocks_dequantize_to_the_bit_as_the_gguf_package_does(kind):
    """Every byte pattern (NaN and infinite scales included) gives the package's float32 bits."""
    rng = np.random.default_rng(int(kind))
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = 48, 2 * max(block_values, 256)
    raw = rng.integers(0, 256, size=(rows, cols // block_values * block_bytes), dtype=np.uint8)
    stored = raw.view({0: np.float32, 1: np.float16}.get(int(kind), np.uint8))
    want = torch.from_numpy(gguf.dequantize(stored, kind).astype(np.float32).reshape(rows, cols))
    got = dequantize(torch.from_numpy(raw.copy()), int(kind), (rows, cols))
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_dequantized_into_a_slot_in_chunks_is_the_package_to_the_bit(kind, monkeypatch):
    """The worker's path: written in place chunk by chunk (a chunk boundary inside a row, a last short
    chunk), from bytes at an odd offset, into float32 and bfloat16 slots (one cast, as transformers)."""
    kind = gguf.GGMLQuantizationType[kind]
    monkeypatch.setattr(gguf_blocks, "_CHUNK_VALUES", 3 * 256)
    rng = np.random.default_rng(7 + int(kind))
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = 10, 3 * 256
    raw = rng.integers(0, 256, size=rows * cols // block_values * block_bytes + 1, dtype=np.uint8)
    stored = raw[1:].reshape(rows, -1)
    want = torch.from_numpy(gguf.dequantize(stored, kind).astype(np.float32).reshape(rows, cols))
    odd = torch.from_numpy(raw)[1:]  # storage offset 1: not a whole int32 word
    for dtype in (torch.float32, torch.bfloat16):
        slot = torch.full((rows, cols), 7.0, dtype=dtype)
        dequantize_into(odd, int(kind), slot)
        assert torch.equal(
            slot.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
            want.to(dtype).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        )


# -- a whole file against transformers' loading of it ------------------------------------------------
@pytest.mark.parametrize(
    "family, qtype", _params([(f, t) for f in ("qwen3_moe", "qwen2_moe") for t in GGUF_TYPES])
)
def test_every_tensor_and_expert_equals_transformers_gguf_loading(gguf_file, family, qtype):
    path = gguf_file(family, qtype)
    checkpoint = GgufCheckpoint(path)
    want = reference_model(path).state_dict()
    main = checkpoint.non_expert_state_dict()
    assert main.keys() == {k for k in want if ".experts." not in k}
    assert all(torch.equal(main[k].to(want[k].dtype), want[k]) for k in main)
    # the worker's path: the experts kept as stored, dequantized on each load into the slot
    store = ExpertStore.build(checkpoint, checkpoint.moe_layers, torch.float32)
    assert store.holdings()["gguf"]["experts"] == len(store.keys())
    for layer in checkpoint.moe_layers:
        prefix = f"model.layers.{layer}.mlp.experts."
        for e in range(checkpoint.num_experts):
            gate_up, down = want[prefix + "gate_up_proj"][e], want[prefix + "down_proj"][e]
            got_gate_up, got_down = torch.empty_like(gate_up), torch.empty_like(down)
            moved = store.load_into((layer, e), got_gate_up, got_down)
            assert torch.equal(got_gate_up, gate_up) and torch.equal(got_down, down), (layer, e)
            assert moved == checkpoint.quantized_expert(layer, e).nbytes  # the bytes as stored


def test_bf16_slots_take_transformers_cast(gguf_file):
    """model.dtype=bfloat16: each expert dequantized to float32 then cast once, as from_pretrained casts."""
    path = gguf_file("qwen3_moe", "Q4_K_M")
    want = reference_model(path, torch.bfloat16).state_dict()
    checkpoint = GgufCheckpoint(path)
    store = ExpertStore.build(checkpoint, checkpoint.moe_layers, torch.bfloat16)
    layer = checkpoint.moe_layers[-1]
    gate_up = want[f"model.layers.{layer}.mlp.experts.gate_up_proj"][3]
    down = want[f"model.layers.{layer}.mlp.experts.down_proj"][3]
    got_gate_up, got_down = torch.empty_like(gate_up), torch.empty_like(down)
    store.load_into((layer, 3), got_gate_up, got_down)
    assert torch.equal(got_gate_up, gate_up) and torch.equal(got_down, down)


def test_q4_k_experts_are_a_quarter_of_bf16(gguf_file):
    checkpoint = GgufCheckpoint(gguf_file("qwen3_moe", "Q4_K"))
    stored = checkpoint.quantized_expert(checkpoint.moe_layers[0], 0).nbytes
    assert stored == 0.28125 * checkpoint.expert_bytes(torch.bfloat16)  # 4.5 bits a weight


def test_where_the_widths_agree_the_config_is_transformers_own(tmp_path):
    """Qwen3-MoE experts 768 wide (the class default, Qwen3-30B-A3B's): transformers loads the file
    without config=, and odmoe's config and tensors equal what it loads."""
    source = make_model(ModelSpec(**{**SPEC.__dict__, "intermediate": 768, "layers": 1}), tmp_path / "st")
    path = write_gguf(source, tmp_path / "gguf", "Q8_0")
    checkpoint = GgufCheckpoint(path)
    own = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    assert checkpoint.config.to_dict() == own.to_dict()
    want = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).state_dict()
    expert = checkpoint.expert(0, 1)
    assert torch.equal(expert.gate_up, want["model.layers.0.mlp.experts.gate_up_proj"][1])
    main = checkpoint.non_expert_state_dict()
    assert all(torch.equal(main[k], want[k]) for k in main)


def test_the_tokenizer_and_chat_template_come_from_the_file(gguf_sources, gguf_file):
    """transformers' tokenizer built from the file's metadata (a Qwen2 tokenizer, as for every Qwen
    GGUF: its pre-tokenizer is Qwen2's, not the source model's, so ids can differ from the source's)."""
    path = gguf_file("qwen3_moe", "Q4_K_M")
    got, source = load_tokenizer(path), AutoTokenizer.from_pretrained(gguf_sources["qwen3_moe"])
    want = AutoTokenizer.from_pretrained(Path(path).parent, gguf_file=Path(path).name)
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    assert got(text)["input_ids"] == want(text)["input_ids"] and got.decode(got(text)["input_ids"]) == text
    assert got.chat_template == source.chat_template and got.eos_token_id == source.eos_token_id
    chat = [{"role": "user", "content": "hi"}]
    assert got.apply_chat_template(chat, tokenize=False) == source.apply_chat_template(chat, tokenize=False)


@pytest.mark.extended  # the default run's cluster test (tests/test_gguf_cluster.py) covers it
def test_requests_in_process_equal_transformers(gguf_file):
    """Greedy and seeded requests together through main's decode loop, workers dequantizing the
    stored blocks, each equal to transformers' generate() on its own GGUF loading."""
    from odmoe.main.engine import GenerateRequest
    from odmoe.main.inprocess import engine_in_process
    from tests.test_engine_inprocess import PROMPTS, SAMPLINGS, serve

    path = gguf_file("qwen3_moe", "Q4_K_M")
    model, tokenizer = reference_model(path), load_tokenizer(path)
    want = {}
    for i, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        params = SAMPLINGS[i % 2]
        if params.do_sample:
            torch.manual_seed(params.seed)
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, **params.generate_kwargs()
        )
        want[f"r{i}"] = out[0, ids.shape[1] :].tolist()
    engine, _ = engine_in_process(path, max_running=4)
    requests = [
        GenerateRequest(p, max_new_tokens=10, request_id=f"r{i}", sampling=SAMPLINGS[i % 2])
        for i, p in enumerate(PROMPTS)
    ]
    assert serve(engine, {0: requests}) == want
    assert len({tuple(t) for t in want.values()}) > 1  # a model whose tokens depend on the prompt


def test_sharded_files_read_as_one(gguf_file):
    one, sharded = gguf_file("qwen3_moe", "Q4_K_M"), gguf_file("qwen3_moe", "Q4_K_M", shards=3)
    assert re.search(r"-00001-of-00003\.gguf$", sharded)
    second = sharded.replace("-00001-of-", "-00002-of-")
    a, b = GgufCheckpoint(one), GgufCheckpoint(second)  # any shard names the set
    assert b.path.name.endswith("-00001-of-00003.gguf") and len(b.files) == 3
    assert a.weight_map.keys() == b.weight_map.keys() and "lm_head.weight" in b.weight_map
    assert {**a.config.to_dict(), "_name_or_path": ""} == {**b.config.to_dict(), "_name_or_path": ""}
    assert all(torch.equal(a.tensor(k), b.tensor(k)) for k in a.weight_map if ".experts." not in k)
    assert torch.equal(a.expert(1, 2).down, b.expert(1, 2).down)
    assert load_tokenizer(second)("x = [1]")["input_ids"] == load_tokenizer(one)("x = [1]")["input_ids"]


def test_make_model_writes_a_file_transformers_reads(tmp_path, capsys):
    from odmoe.launch.make_model import main

    out = tmp_path / "m"
    argv = [
        "--family",
        "qwen2_moe",
        "--layers",
        "1",
        "--hidden",
        "256",
        "--intermediate",
        "256",
        "--experts",
        "4",
    ]
    assert main([*argv, "--vocab", "512", "--gguf", "Q4_K_M", "--out", str(out)]) == 0
    assert "as stored in GGUF" in capsys.readouterr().out
    path = out / "model-Q4_K_M.gguf"
    config = open_checkpoint(path).config
    model = AutoModelForCausalLM.from_pretrained(out, gguf_file=path.name, config=config)
    assert model.config.model_type == "qwen2_moe"
    assert main([*argv, "--family", "mixtral", "--gguf", "Q8_0", "--out", str(tmp_path / "x")]) == 2


# -- refusals: one line, at open, before a tensor is read ---------------------------------------------
def _corrupt(path: str, tmp_path: Path, name: str, edit) -> Path:
    data = bytearray(Path(path).read_bytes())
    edit(data)
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return out


def _type_field(data: bytearray, tensor: str) -> int:
    """Byte offset of `tensor`'s ggml type in the header's tensor infos (name, dims, shape, type)."""
    at = data.index(tensor.encode()) + len(tensor)
    dims = int.from_bytes(data[at : at + 4], "little")
    return at + 4 + 8 * dims


@pytest.mark.parametrize(
    "name, edit, refusal",
    [
        ("cut.gguf", lambda d: d.__delitem__(slice(len(d) - 4096, None)), "truncated or corrupt"),
        ("magic.gguf", lambda d: d.__setitem__(slice(0, 4), b"GGML"), "truncated or corrupt"),
        (
            "newer.gguf",
            lambda d: d.__setitem__(slice(*_span(d, 4)), (99).to_bytes(4, "little")),
            "ggml type 99, a quantization type the gguf package does not know",
        ),
        (
            "q8k.gguf",
            lambda d: d.__setitem__(slice(*_span(d, 4)), (15).to_bytes(4, "little")),
            "stored as Q8_K, which the gguf package cannot dequantize",
        ),
    ],
)
def test_a_bad_file_is_refused_in_one_line(gguf_file, tmp_path, name, edit, refusal):
    bad = _corrupt(gguf_file("qwen3_moe", "Q8_0"), tmp_path, name, edit)
    with pytest.raises(CheckpointError, match=refusal) as caught:
        open_checkpoint(bad)
    assert "\n" not in str(caught.value)


def _span(data: bytearray, width: int) -> tuple[int, int]:
    at = _type_field(data, "blk.0.attn_q.weight")
    return at, at + width


def test_shards_that_do_not_match_are_refused(gguf_file, tmp_path):
    sharded = Path(gguf_file("qwen3_moe", "Q4_K_M", shards=3))
    other = Path(gguf_file("qwen3_moe", "Q8_0", shards=3))
    for f in sharded.parent.glob("*.gguf"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / sharded.name.replace("00001-of", "00003-of")).unlink()
    with pytest.raises(CheckpointError, match="shards missing beside it: .*-00003-of-00003.gguf"):
        open_checkpoint(tmp_path / sharded.name)
    shutil.copy(
        other.with_name(other.name.replace("00001-of", "00002-of")),
        tmp_path / sharded.name.replace("00001-of", "00003-of"),
    )
    with pytest.raises(CheckpointError, match="shard 2 of 3 by its metadata, found as 3 of 3"):
        open_checkpoint(tmp_path / sharded.name)


@pytest.mark.parametrize(
    "arch, refusal",
    [
        (
            "llama",
            "architecture 'llama' \\(8 experts\\): not served \\(transformers reads a llama GGUF as a dense",
        ),
        ("deepseek2", "architecture 'deepseek2' \\(8 experts\\): not served"),
        (
            "gpt-oss",
            "architecture 'gpt-oss' \\(8 experts\\): not served \\(transformers 5.24 maps none of its",
        ),
    ],
)
def test_an_architecture_transformers_cannot_load_is_refused_naming_what_is_served(tmp_path, arch, refusal):
    from odmoe.launch.local_cluster import LocalCluster

    writer = gguf.GGUFWriter(tmp_path / "m.gguf", arch)
    writer.add_block_count(1)
    writer.add_expert_count(8)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((8, 4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        UnsupportedModelError, match=refusal + ".*odmoe serves GGUF files of qwen2moe, qwen3moe"
    ):
        open_checkpoint(tmp_path / "m.gguf")
    with pytest.raises(UnsupportedModelError, match=refusal):  # before any node process starts
        LocalCluster(str(tmp_path / "m.gguf"))


def test_transformers_still_leaves_gpt_oss_experts_unread():
    """Why gpt-oss GGUF files are refused: transformers 5.24's GGUF name map over a gpt-oss model
    reaches none of the names llama.cpp writes for its experts and sinks. When a release maps them,
    this fails: serve gpt-oss GGUF then."""
    from transformers import GptOssConfig
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    from odmoe.models.load_dtypes import meta_skeleton

    config = GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_local_experts=4)
    # load_gguf_checkpoint: TENSOR_PROCESSORS.get(architecture, TensorProcessor), the file's "gpt-oss"
    processor = TENSOR_PROCESSORS.get("gpt-oss", TensorProcessor)(config=config.to_dict())
    mapped = get_gguf_hf_weights_map(meta_skeleton(config, torch.float32), processor)
    llama_cpp = [f"blk.0.{n}" for n in ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")]
    llama_cpp += ["blk.0.ffn_gate_exps.bias", "blk.0.ffn_down_exps.bias", "blk.0.attn_sinks.weight"]
    assert not [n for n in llama_cpp if n in mapped]
    assert "gpt-oss" not in TENSOR_PROCESSORS


def test_model_gguf_file_names_the_file_in_a_directory(gguf_file, tmp_path):
    from odmoe.launch.local_cluster import resolve_model_path
    from odmoe.launch.settings import compose

    path = Path(gguf_file("qwen3_moe", "Q4_K_M"))
    cfg = compose(["role=local", f"model.path={path.parent}", f"model.gguf_file={path.name}"])
    assert resolve_model_path(cfg) == str(path)
    cfg = compose(["role=local", f"model.path={path.parent}"])  # the directory's only GGUF model
    assert resolve_model_path(cfg) == str(path)
    shutil.copy(path, tmp_path / "a.gguf")
    shutil.copy(path, tmp_path / "b.gguf")
    with pytest.raises(
        CheckpointError, match="holds 2 GGUF models \\(a.gguf, b.gguf\\): name one with model.gguf_file="
    ):
        resolve_model_path(compose(["role=local", f"model.path={tmp_path}"]))
    with pytest.raises(ValueError, match="is not a .gguf file name"):
        compose(["role=local", f"model.path={tmp_path}", "model.gguf_file=a/b.gguf"])
