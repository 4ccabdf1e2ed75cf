"""The demo model's training text, shipped with odmoe so the demo is the same model everywhere.

Contract: `documents()` returns the shipped corpus (`data/demo_corpus.jsonl.gz`, one JSON string
per line, one Python module per string) in a fixed order; the demo's tokenizer and its training
both read it and nothing else. `build(out)` remakes such a file from the running interpreter's
standard library; run as `python -m odmoe.tools.demo_corpus OUT`.

Why a file and not the interpreter's own sources (what the benchmark models train on): those are a
different text on every Python version, so the demo model, and the text the README shows, changed
with the interpreter. The shipped file was built once, with CPython 3.11.7: the first ~4 MB of
`Lib/*.py` in sorted order (tests, vendored and generated code left out), each module reduced to
code by `odmoe.tools.training.code_only` (comments and docstrings dropped, `ast.unparse`'s layout).
It is kept as that final text: `ast.unparse` itself writes differently on other versions, so
rebuilding elsewhere gives another file, which is the point of shipping this one.

The text is CPython's, under the Python Software Foundation License (see data/NOTICE).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import sys
from pathlib import Path

CORPUS_FILE = Path(__file__).resolve().parent.parent / "data" / "demo_corpus.jsonl.gz"
# The digest of the uncompressed text: the demo model's cache name carries it, and a test checks
# the shipped file still has it (gzip's own bytes may differ between zlib builds; the text may not).
CORPUS_SHA256 = "2a842ff0c02aadcad764a3bf3356ef83c6d898bd7b6f1545530c884e7177aa77"
SOURCE_BYTES = 4_000_000  # of standard-library sources read when building


@functools.cache
def documents() -> tuple[str, ...]:
    """The shipped corpus, one Python module per item, in the order the demo trains on them."""
    if not CORPUS_FILE.is_file():
        raise FileNotFoundError(f"the demo corpus {CORPUS_FILE} is missing from this install")
    with gzip.open(CORPUS_FILE, "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def text_digest(docs: tuple[str, ...] | list[str]) -> str:
    """sha256 of the documents as they are trained on (the order and the boundaries included)."""
    h = hashlib.sha256()
    for doc in docs:
        h.update(doc.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


def build(out: Path, source_bytes: int = SOURCE_BYTES) -> Path:
    """Write a corpus file from this interpreter's standard library (code only, fixed order)."""
    from odmoe.tools.corpora import code_only, corpus_files

    docs = [code_only(Path(p).read_text(errors="replace")) for p in corpus_files(source_bytes)]
    lines = "".join(json.dumps(doc) + "\n" for doc in docs if doc)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(gzip.compress(lines.encode("utf-8"), compresslevel=9, mtime=0))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m odmoe.tools.demo_corpus OUT.jsonl.gz  (from this interpreter's stdlib)")
    path = build(Path(sys.argv[1]))
    with gzip.open(path, "rt", encoding="utf-8") as f:
        built = tuple(json.loads(line) for line in f)
    print(f"{path}: {len(built)} modules, {sum(map(len, built))} characters, sha256 {text_digest(built)}")
