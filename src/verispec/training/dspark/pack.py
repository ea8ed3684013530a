"""`verispec dspark pack`: regenerated answers as the repository keeps them, token ids only,
xz-compressed, so a later session on a new machine trains on them instead of regenerating.

A pack is one xz stream: the line `VSPACK1`, one JSON line of metadata (token width in
bytes, the tokenizer's vocabulary size, per record [id, source, finish_reason, prompt
length, answer length], and `left_out`: the ids of prompts whose answers were left out for
sharing an eval prompt's 8-word run, so datagen `--packed` does not ask them again on a
machine without the JSONL), then every record's prompt ids and answer ids back to back as
little-endian unsigned integers. Texts are left out (the ids are what training reads; the
tokenizer decodes them). Packing a JSONL again adds only the records the pack lacks, in
order, so packs grow with the data. `verispec dspark features --data` reads a pack as it
reads datagen's JSONL (features.read_records).

Checked by tests/test_dspark_data.py: JSONL -> pack -> records round-trips exactly, repacking
is idempotent and appends only new records, a left-out answer's id is kept and counts as done.
"""

from __future__ import annotations

import json
import lzma
import sys
from array import array
from pathlib import Path

from verispec.errors import UserError

MAGIC = b"VSPACK1\n"
SUFFIX = ".pack.xz"


def is_pack(path: Path) -> bool:
    return str(path).endswith(SUFFIX)


def write_pack(path: Path, records: list[dict], vocab_size: int, left_out: list[str] = ()) -> None:
    width = 2 if vocab_size <= 1 << 16 else 4
    tokens = array("H" if width == 2 else "I")
    rows = []
    for r in records:
        tokens.extend(r["prompt_ids"])
        tokens.extend(r["answer_ids"])
        rows.append([r["id"], r.get("source", ""), r.get("finish_reason", ""), len(r["prompt_ids"]),
                     len(r["answer_ids"])])
    if sys.byteorder != "little":
        tokens.byteswap()
    meta = {"width": width, "vocab_size": vocab_size, "records": rows}
    if left_out:
        meta["left_out"] = list(left_out)
    tmp = path.with_name(path.name + ".tmp")
    with lzma.open(tmp, "wb", preset=9 | lzma.PRESET_EXTREME) as f:
        f.write(MAGIC + json.dumps(meta, separators=(",", ":")).encode() + b"\n" + tokens.tobytes())
    tmp.replace(path)  # never a half-written pack in place of a good one


def read_pack(path: Path) -> tuple[dict, list[dict]]:
    """(metadata, records with id, source, finish_reason, prompt_ids, answer_ids)."""
    try:
        data = lzma.open(path, "rb").read()
    except (lzma.LZMAError, EOFError) as e:
        raise UserError(f"{path}: not a readable pack ({e})") from None
    if not data.startswith(MAGIC):
        raise UserError(f"{path}: not a verispec dspark pack")
    end = data.index(b"\n", len(MAGIC))
    meta = json.loads(data[len(MAGIC) : end])
    tokens = array("H" if meta["width"] == 2 else "I")
    tokens.frombytes(data[end + 1 :])
    if sys.byteorder != "little":
        tokens.byteswap()
    records, at = [], 0
    for key, source, finish, n_prompt, n_answer in meta["records"]:
        prompt = tokens[at : at + n_prompt].tolist()
        answer = tokens[at + n_prompt : at + n_prompt + n_answer].tolist()
        at += n_prompt + n_answer
        records.append({"id": key, "source": source, "finish_reason": finish, "prompt_ids": prompt,
                        "answer_ids": answer})
    if at != len(tokens):
        raise UserError(f"{path}: {len(tokens) - at} token ids more than its records describe")
    return meta, records


def done_ids(path: Path) -> set[str]:
    """The prompt ids a pack has settled: those it holds an answer for and those left out."""
    meta, records = read_pack(path)
    return {r["id"] for r in records} | set(meta.get("left_out", []))


def model_vocab_size(model: str) -> int:
    """The vocabulary size in a model's config.json (a multimodal config's text_config's)."""
    from verispec.models.config import read_config
    from verispec.models.registry import resolve_model

    cfg = read_config(resolve_model(model))
    size = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    if not size:
        raise UserError(f"{model}: its config.json names no vocab_size; give --vocab-size")
    return int(size)


def run_pack(args) -> int:
    from verispec.data.decontaminate import contaminated
    from verispec.training.dspark.datagen import record_texts
    from verispec.training.dspark.features import read_records

    out = Path(args.out)
    if not is_pack(out):
        raise UserError(f"--out {out}: a pack's name ends in {SUFFIX}")
    existing: list[dict] = []
    left_out: list[str] = []
    vocab = args.vocab_size
    if out.is_file():
        meta, existing = read_pack(out)
        vocab, left_out = meta["vocab_size"], meta.get("left_out", [])
    if vocab is None and getattr(args, "model", None):
        vocab = model_vocab_size(args.model)
    if vocab is None:
        raise UserError("a new pack needs the target's vocabulary size (it sets the id width): -m MODEL or --vocab-size")
    have = {r["id"] for r in existing} | set(left_out)
    incoming = [r for r in read_records(Path(args.data), min_loss_tokens=0) if r["id"] not in have]
    added = [r for r in incoming if "answer_ids" in r]
    # datagen's left-out records (no answer) are settled: their ids travel with the pack
    left_out += [r["id"] for r in incoming if "answer_ids" not in r and r.get("left_out")]
    # never keep an eval prompt's 8-word run, in a prompt, in an answer, or across the two as the
    # model reads them (a base model's answer continues its prompt's last words: a count "71/ 72/"
    # went on in the answer). datagen checks prompt and answer apart; this is the gate for the
    # joined text, and for data made before datagen filtered answers, or by other tools
    def spoiled(r: dict) -> bool:
        prompts, answer = record_texts(r), r.get("answer") or ""
        return contaminated(*prompts, answer, prompts[-1] + answer)

    quoting = {r["id"] for r in added if spoiled(r)}
    fresh = [r for r in added if r["id"] not in quoting]
    left_out += [r["id"] for r in added if r["id"] in quoting]
    if len(fresh) < len(added):
        print(f"pack: {len(added) - len(fresh)} records left out: they share an 8-word run with an eval prompt",
              file=sys.stderr)
    added = fresh
    too_big = [r["id"] for r in added if max(r["prompt_ids"] + r["answer_ids"], default=0) >= vocab]
    if too_big:
        raise UserError(f"{args.data}: record {too_big[0]} has token ids beyond the vocabulary of {vocab}")
    out.parent.mkdir(parents=True, exist_ok=True)
    left_out = list(dict.fromkeys(left_out))
    write_pack(out, existing + added, vocab, left_out)
    tokens = sum(len(r["prompt_ids"]) + len(r["answer_ids"]) for r in existing + added)
    print(f"pack: {len(added)} new records, {len(existing) + len(added)} in all ({tokens} token ids), {len(left_out)} "
          f"left-out prompt ids -> {out} ({out.stat().st_size / 2**20:.2f} MB)", file=sys.stderr)
    return 0
