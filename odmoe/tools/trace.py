"""Timeline spans of every node, merged into a Chrome trace (chrome://tracing, ui.perfetto.dev).

Off by default and then free: every call returns at once. On (`trace_dir` set), a node keeps
complete events in memory and appends them as JSON lines to `<trace_dir>/<node>.jsonl` on `flush`
(main after each request, the shadow after each request, a worker whenever it is idle). Times are
wall-clock microseconds: nodes on one machine share that clock; on a LAN, synchronise the clocks
(NTP/PTP) before reading one node's spans against another's.

A message is drawn as a flow arrow: the sender calls `flow(key, start=True)` and the receiver
`flow(key, start=False)` with the same key; `message` builds that key for a main <-> worker message
about one expert of one decode step.
"""

from __future__ import annotations

import json
import time
import zlib
from pathlib import Path


def now_us() -> float:
    return time.time() * 1e6


class Tracer:
    def __init__(self, node: str, directory: str | None = None):
        self.node = node
        self.enabled = bool(directory)
        self.path = Path(directory) / f"{node}.jsonl" if directory else None
        self.events: list[dict] = []
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def span(self, lane: str, name: str, start_us: float, end_us: float, **args) -> None:
        if self.enabled:
            self.events.append(
                {
                    "lane": lane,
                    "name": name,
                    "ph": "X",
                    "ts": start_us,
                    "dur": max(end_us - start_us, 0.0),
                    "args": args,
                }
            )

    def instant(self, lane: str, name: str, at_us: float | None = None, **args) -> None:
        if self.enabled:
            self.events.append(
                {"lane": lane, "name": name, "ph": "i", "s": "t", "ts": at_us or now_us(), "args": args}
            )

    def flow(self, lane: str, key: str, start: bool, at_us: float | None = None) -> None:
        if self.enabled:
            event = {
                "lane": lane,
                "name": key.split("/")[0],
                "ph": "s" if start else "f",
                "id": zlib.crc32(key.encode()),
                "ts": at_us or now_us(),
                "args": {},
            }
            if not start:
                event["bp"] = "e"  # bind to the enclosing span at the arrival time
            self.events.append(event)

    def message(self, lane: str, kind: str, step, expert: int, sent: bool) -> None:
        """A "compute" (main -> worker) or "result" (worker -> main) message for `expert` at `step`."""
        if self.enabled:
            self.flow(lane, f"{kind}/{step.request}/{step.iteration}/{step.layer}/{expert}", sent)

    def flush(self) -> None:
        if not self.enabled or not self.events:
            return
        with self.path.open("a") as f:
            for event in self.events:
                f.write(json.dumps(event) + "\n")
        self.events = []


def merge(directory: str | Path) -> dict:
    """Every node's spans in one Chrome trace: a process per node, a thread per lane."""
    directory = Path(directory)
    events, pids = [], {}
    for path in sorted(directory.glob("*.jsonl")):
        node = path.stem
        pid = pids.setdefault(node, len(pids) + 1)
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": node}})
        tids: dict[str, int] = {}
        for line in path.read_text().splitlines():
            event = json.loads(line)
            lane = event.pop("lane")
            if lane not in tids:
                tids[lane] = len(tids) + 1
                events.append(
                    {"ph": "M", "name": "thread_name", "pid": pid, "tid": tids[lane], "args": {"name": lane}}
                )
            events.append({**event, "pid": pid, "tid": tids[lane], "cat": node})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
