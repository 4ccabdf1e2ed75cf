"""Stop strings over a stream of text pieces, as OpenAI's `stop` parameter means them.

Contract: `StopStrings(stops).feed(piece)` returns `(text, stopped)`: the text that may be shown now
and whether a stop string has appeared. The output never contains a stop string nor anything after
it; text that could still be the start of a stop string is held back until the next piece settles
it (a stop string split across tokens is caught, and a partial one is never streamed out).
`flush()` returns what was held back when the stream ends without a stop.

Which stop ends the text when several appear: the one that is complete first, i.e. that ends
earliest in the text (of two ending at the same character, the longer); the text stops before it.
That is when generation stops, and it depends only on the text, never on how the text was cut into
pieces (tokens): with stops "c" and "aca", "aca" gives "a" whether it arrives whole or as "ac" + "a"
(choosing the earliest *start* gave "" whole and "a" cut, since "c" completes before "aca" does).
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: tuple[str, ...] | list[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self.held = ""
        self.stopped = False

    def feed(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return piece, False
        text = self.held + piece
        found = [(i + len(s), i) for s in self.stops if (i := text.find(s)) >= 0]
        if found:
            _end, cut = min(found)  # the stop complete first; at a tie, the longer (earlier start)
            self.held, self.stopped = "", True
            return text[:cut], True
        keep = max((_overlap(text, s) for s in self.stops), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return "" if self.stopped else held


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop` (a stop string maybe under way)."""
    return next((n for n in range(min(len(text), len(stop) - 1), 0, -1) if text.endswith(stop[:n])), 0)
