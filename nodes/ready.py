"""How a node tells whoever started it that it is serving, and where.

The node writes one small JSON file atomically (temp file + rename) once its sockets are bound, so
the launcher can bind every node to port 0 and still learn the real address.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def announce_ready(ready_file: str | None, **info) -> None:
    if not ready_file:
        return
    path = Path(ready_file)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**info, "pid": os.getpid()}))
    os.replace(tmp, path)
