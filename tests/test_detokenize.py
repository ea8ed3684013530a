"""Streaming detokenization against the tokenizer's own full decode (the oracle)."""

from __future__ import annotations

import pytest

from verispec.engine.detokenize import REPLACEMENT, StreamDetokenizer
from verispec.models.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world! Plain ASCII with  double  spaces and\nnewlines.",
    "Ünïcödé façade — naïve café, 東京は日本の首都です。 Ελληνικά",
    "Emoji: 👩‍👩‍👧‍👦 🚀🔥 and flags 🇫🇷🇯🇵 mid-sentence.",
    "  leading spaces, trailing spaces   ",
    "code:\n\tdef f(x):\n\t\treturn x ** 2  # ½ ≤ ∞",
]


def _stream(tokenizer, ids):
    detok = StreamDetokenizer(tokenizer)
    chunks = [detok.push(t) for t in ids]
    chunks.append(detok.flush())
    return chunks


@pytest.mark.real_model
@pytest.mark.parametrize("which", ["smollm2_folder", "gemma_folder"])
def test_stream_equals_full_decode(request, which):
    tokenizer = load_tokenizer(request.getfixturevalue(which))
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        chunks = _stream(tokenizer, ids)
        assert "".join(chunks) == tokenizer.decode(ids, skip_special_tokens=True)
        assert not any(REPLACEMENT in c for c in chunks), chunks


@pytest.mark.real_model
def test_split_multibyte_character_is_held_back(smollm2_folder):
    """A byte-level BPE emits a 4-byte emoji as several tokens; none of them may leak a
    replacement character, and the emoji appears whole in a single chunk."""
    tokenizer = load_tokenizer(smollm2_folder)
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1, "test premise: the emoji spans several tokens"
    chunks = _stream(tokenizer, ids)
    assert [c for c in chunks if c] == ["🚀"]


@pytest.mark.real_model
def test_special_tokens_are_not_content(smollm2_folder):
    tokenizer = load_tokenizer(smollm2_folder)
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(_stream(tokenizer, ids)) == "Hi"
