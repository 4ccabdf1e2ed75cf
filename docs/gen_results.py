"""Copy the committed benchmark results into the docs at build time (the mkdocs-gen-files plugin).

MkDocs serves only what lies under docs/, and the pictures, JSON and printed tables the pages quote
live in benchmarks/results/ beside the suites that wrote them. Copying them into the build's virtual
tree as results/<name> keeps one copy in git: a page refers to `results/x.png` (or `../results/x.png`
from a sub-folder), and a missing file fails `mkdocs build --strict`.
"""

from pathlib import Path

import mkdocs_gen_files

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"

for path in sorted(RESULTS.iterdir()):
    if path.is_file() and path.suffix in (".png", ".json", ".txt"):
        with mkdocs_gen_files.open(f"results/{path.name}", "wb") as out:
            out.write(path.read_bytes())
