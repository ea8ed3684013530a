"""Stop strings: the streaming matcher against a whole-text oracle.

Oracle: after each piece, look at the whole text so far; at the first piece where a stop
string occurs, the output is that text cut at the earliest occurrence; if none ever
occurs, the output is the whole text. The matcher must release exactly that, in order,
whatever the split into pieces, and must never release text that a later stop string
would cut.
"""

from __future__ import annotations

import random

import pytest

from verispec.engine.stop import StopMatcher
from verispec.engine.textstream import TextStream
from verispec.models.tokenizer import load_tokenizer


def oracle(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    text = ""
    for piece in pieces:
        text += piece
        hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
        if hits:
            return text[: min(hits)], True
    return text, False


def run_matcher(pieces: list[str], stops: list[str]) -> tuple[str, bool, list[str]]:
    m = StopMatcher(stops)
    released = []
    for piece in pieces:
        out, stopped = m.feed(piece)
        released.append(out)
        if stopped:
            return "".join(released), True, released
    released.append(m.flush())
    return "".join(released), False, released


def _random_split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 8)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def oracle_stop(pieces: list[str], stops: list[str]) -> str | None:
    """Which stop string ended it: the earliest occurrence, the first listed on a tie."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [(i, n, s) for n, s in enumerate(stops) if s and (i := text.find(s)) >= 0]
        if hits:
            return min(hits)[2]
    return None


def test_the_matcher_says_which_stop_string_ended_the_text():
    rng = random.Random(1)
    for _ in range(3000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        pieces = _random_split(text, rng)
        m = StopMatcher(stops)
        for piece in pieces:
            if m.feed(piece)[1]:
                break
        assert m.matched == oracle_stop(pieces, stops), (pieces, stops)


def test_matches_oracle_on_random_texts_and_splits():
    rng = random.Random(0)
    stopped_cases = 0
    for _ in range(5000):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        pieces = _random_split(text, rng)
        got, stopped, _ = run_matcher(pieces, stops)
        want, want_stopped = oracle(pieces, stops)
        assert (got, stopped) == (want, want_stopped), (pieces, stops)
        stopped_cases += stopped
    assert 500 < stopped_cases < 4500, "test premise: both outcomes are common"


def test_stop_spanning_pieces_is_held_back_then_cut():
    m = StopMatcher(["</answer>"])
    assert m.feed("The result is 4</") == ("The result is 4", False)
    assert m.held == 2
    assert m.feed("ans") == ("", False)
    assert m.feed("wer> and more") == ("", True)


def test_false_partial_match_is_released_once_it_cannot_match():
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("AR") == ("STAR", False)
    assert m.flush() == ""


def test_no_stops_is_a_passthrough():
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)


@pytest.mark.real_model
def test_text_stream_cuts_real_tokens_exactly(smollm2_folder):
    """Real tokenizer, stop strings that start and end inside tokens: the released text is
    the full decode cut at the stop string, and the released tokens are exactly those
    whose text starts before the cut."""
    tokenizer = load_tokenizer(smollm2_folder)
    text = "Paris is the capital of France. Its café culture — ☕ and 🥐 — is famous.\nNext line."
    ids = tokenizer.encode(text, add_special_tokens=False)
    full = tokenizer.decode(ids)
    # where each token's text starts: characters completed before it (a token that only
    # carries the first bytes of a character starts where that character does)
    starts = [len(tokenizer.decode(ids[:j]).rstrip("\ufffd")) for j in range(len(ids))]
    for stop in ["apital of", "é cul", "🥐 —", "\nNext", "famous.\n", "line.", "not in the text"]:
        stream = TextStream(tokenizer, [stop])
        released, n_tokens, stopped = "", 0, False
        for token in ids:
            r = stream.push(token)
            released += r.text
            n_tokens += r.tokens
            if r.stopped:
                stopped = True
                break
        if not stopped:
            r = stream.finish()
            released, n_tokens = released + r.text, n_tokens + r.tokens
        cut = full.find(stop)
        if cut < 0:
            assert (released, n_tokens, stopped) == (full, len(ids), False)
        else:
            assert released == full[:cut] and stopped
            assert n_tokens == sum(1 for s in starts if s < cut)
