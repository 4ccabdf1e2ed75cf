"""Stop strings over a stream of pieces: pure logic, checked against the whole text."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from odmoe.main.stop_strings import StopStrings

# starts no process and trains nothing: the fast tier (-m fast) runs this file's default tests
pytestmark = pytest.mark.pure


def run(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    s = StopStrings(stops)
    out, stopped = [], False
    for piece in pieces:
        text, stopped = s.feed(piece)
        out.append(text)
        if stopped:
            break
    if not stopped:
        out.append(s.flush())
    return out, stopped


def test_a_stop_split_across_pieces_is_caught_and_never_shown():
    out, stopped = run(["def f", "(x):\n  ", "  ret", "urn x"], ["return"])
    assert stopped and "".join(out) == "def f(x):\n    "
    assert out[2] == "  "  # "ret" could start the stop string: held back, then dropped


def test_held_text_that_is_not_a_stop_is_released():
    out, stopped = run(["ab", "c", "d"], ["cx"])
    assert not stopped and out == ["ab", "", "cd", ""]


def test_the_earliest_of_several_stops_wins():
    out, stopped = run(["one two three"], ["three", "two"])
    assert stopped and "".join(out) == "one "


def test_the_stop_complete_first_wins_however_the_text_is_cut():
    """Found by the property below (CI, 2026-11-26): "c" completes before "aca" starts to matter."""
    assert run(["aca"], ["c", "aca"]) == (["a"], True)
    assert "".join(run(["ac", "a"], ["c", "aca"])[0]) == "a"
    assert run(["xaca"], ["ca", "aca"]) == (["x"], True)  # "ca" and "aca" end together: the longer


alphabet = st.text(alphabet="abc", max_size=30)


@given(
    text=alphabet,
    cuts=st.lists(st.integers(0, 30), max_size=8),
    stops=st.lists(st.text("abc", min_size=1, max_size=3), max_size=3),
)
def test_any_split_gives_the_text_up_to_the_first_stop(text, cuts, stops):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    out, stopped = run(pieces, stops)
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]  # (end, start)
    want = text[: min(hits)[1]] if hits else text  # before the stop complete first
    assert "".join(out) == want
    assert stopped == bool(hits)
    shown = ""
    for piece in out:  # nothing shown is ever taken back: every prefix shown is a prefix of the answer
        shown += piece
        assert want.startswith(shown)


def test_a_request_ending_mid_character_streams_what_decode_gives(model_dirs):
    """The streamed pieces add up to decode(tokens), an unfinished last character included (its
    bytes were held back for the rest of the character, and lost when no more token came)."""
    from transformers import AutoTokenizer

    from odmoe.main.request_run import _Detokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs["mixtral"])
    ids = tok("naïve café €")["input_ids"]
    cut = next(n for n in range(1, len(ids) + 1) if tok.decode(ids[:n]).endswith("\ufffd"))
    text = _Detokenizer(tok)
    pieces = "".join(text.add(t) for t in ids[:cut])
    assert not pieces.endswith("\ufffd")  # held back while the character may still complete
    assert pieces + text.flush() == tok.decode(ids[:cut])
