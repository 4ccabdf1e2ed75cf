"""Which files a GGUF model is and where its tensors lie in them, from the files' headers alone.

Contract: `shard_set(path)` lists every shard of the set `path` belongs to (`-0000K-of-0000N.gguf`
names N shards; any other name is a set of one), in order, whether present or not. `gguf_layout(path)`
gives (where the tensor data begins, {tensor name: (absolute start, end)}) as the file's header
says (the `gguf` package's reader; nothing but the header is read). The checkpoint reader and the
checkpoint index both use these; this module imports neither.
"""

from __future__ import annotations

import re
from pathlib import Path

SHARD = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_set(path: Path) -> list[Path]:
    match = SHARD.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    return [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def gguf_layout(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    ranges = {t.name: (int(t.data_offset), int(t.data_offset) + int(t.n_bytes)) for t in reader.tensors}
    return int(reader.data_offset), ranges
