"""Keep drafter training data away from the benchmark prompts: n-gram decontamination.

A training text is contaminated when it shares a run of NGRAM (8) normalized words with any
turn of any eval prompt (the four sets in ../shared/eval-prompts); normalized means lower
case, words are runs of letters and digits. Eval turns shorter than NGRAM words are left
out (mt-bench's "Now rewrite it." follow-ups: generic, and everywhere in chat data).

The eval side travels with the package as a fingerprint, `eval_ngrams.bin` (the sorted
6-byte BLAKE2b hashes of every eval 8-gram), so a clone without ../shared filters exactly
the same way; `verispec dspark fingerprint` rebuilds it from the eval files, and
tests/test_decontaminate.py checks it against them where they are present (false positives
at 6 bytes: ~1e-7 per n-gram, a few per million training prompts).
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import cache
from pathlib import Path

NGRAM = 8
HASH_BYTES = 6
FINGERPRINT = Path(__file__).with_name("eval_ngrams.bin")
_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def ngram_hashes(text: str) -> set[bytes]:
    w = words(text)
    return {hashlib.blake2b(" ".join(w[i : i + NGRAM]).encode(), digest_size=HASH_BYTES).digest()
            for i in range(len(w) - NGRAM + 1)}


def eval_turns(folder: Path) -> list[str]:
    """Every turn of every eval prompt in `folder` (mt-bench, gsm8k, humaneval, mbpp)."""
    from verispec.data.eval_prompts import EVAL_SETS

    turns = []
    for name in EVAL_SETS:
        for line in (Path(folder) / f"{name}.jsonl").read_text(encoding="utf-8").split("\n"):
            if line.strip():
                turns.extend(json.loads(line)["turns"])
    return turns


def build_fingerprint(folder: Path) -> bytes:
    hashes = set()
    for turn in eval_turns(folder):
        hashes |= ngram_hashes(turn)
    return b"".join(sorted(hashes))


def write_fingerprint(folder: Path, path: Path = FINGERPRINT) -> int:
    data = build_fingerprint(folder)
    path.write_bytes(data)
    return len(data) // HASH_BYTES


@cache
def eval_ngrams(path: Path = FINGERPRINT) -> frozenset[bytes]:
    data = path.read_bytes()
    return frozenset(data[i : i + HASH_BYTES] for i in range(0, len(data), HASH_BYTES))


def contaminated(*texts: str) -> bool:
    """Any of the texts shares an 8-word run with an eval prompt."""
    fingerprint = eval_ngrams()
    return any(not fingerprint.isdisjoint(ngram_hashes(text)) for text in texts if text)
