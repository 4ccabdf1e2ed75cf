"""The demo's training text ships with odmoe and is the same everywhere; the demo trains on it
with torch's and MKL's kernels pinned, so its weights do not depend on the machine's CPU."""

from __future__ import annotations

import dataclasses
import gzip
import json
import platform
from pathlib import Path

import pytest

from odmoe.tools import demo_corpus
from odmoe.tools.model_factory import corpus_documents, corpus_files
from odmoe.tools.training import (
    DEMO_KERNELS,
    DEMO_SETTINGS,
    DEMO_SPEC,
    _train_with_pinned_kernels,
    code_only,
    cpu_vendor,
)

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def test_the_shipped_corpus_is_the_text_the_demo_names():
    docs = demo_corpus.documents()
    assert len(docs) > 100 and all(docs)
    assert demo_corpus.text_digest(docs) == demo_corpus.CORPUS_SHA256
    assert DEMO_SETTINGS.corpus == "demo" and not DEMO_SETTINGS.code_only  # it is code already
    assert corpus_documents("demo") == list(docs)


def test_an_unknown_corpus_is_refused_by_name():
    with pytest.raises(ValueError, match="'wiki' is not one of stdlib, demo"):
        corpus_documents("wiki")


def test_build_writes_one_json_string_per_module_in_a_fixed_order(tmp_path):
    a = demo_corpus.build(tmp_path / "a.jsonl.gz", source_bytes=60_000)
    b = demo_corpus.build(tmp_path / "b.jsonl.gz", source_bytes=60_000)
    assert a.read_bytes() == b.read_bytes()  # mtime=0: the same bytes on every run
    with gzip.open(a, "rt") as f:
        docs = [json.loads(line) for line in f]
    sources = [Path(p).read_text(errors="replace") for p in corpus_files(60_000)]
    assert docs == [code for code in map(code_only, sources) if code]  # code only, in that order


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 pins")
@pytest.mark.integration  # starts a process
def test_the_demo_trains_with_the_pinned_kernels_and_the_same_bits_twice(tmp_path):
    spec = dataclasses.replace(DEMO_SPEC, layers=2, hidden=32, intermediate=32, heads=2, kv_heads=1)
    settings = dataclasses.replace(DEMO_SETTINGS, steps=3, warmup=1, held_out_batches=1)
    runs = []
    for name in ("a", "b"):
        _train_with_pinned_kernels(tmp_path / name, spec, settings)
        report = json.loads((tmp_path / name / "odmoe_training.json").read_text())
        assert report["cpu_capability"] == DEMO_KERNELS["ATEN_CPU_CAPABILITY"].upper()
        assert report["mkl_cbwr"] == DEMO_KERNELS["MKL_CBWR"]
        assert report["cpu_vendor"] == cpu_vendor()  # MKL keeps its pin on GenuineIntel only
        runs.append((tmp_path / name / "model.safetensors").read_bytes())
    assert runs[0] == runs[1]


def test_the_shipped_file_is_packaged():
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert '"odmoe.data" = ["demo_corpus.jsonl.gz", "NOTICE"]' in pyproject
