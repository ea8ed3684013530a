"""`verispec dspark fingerprint`: rebuild the eval-prompt n-gram fingerprint that datagen
filters training prompts with (data/decontaminate.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from verispec.errors import UserError


def run_fingerprint(args) -> int:
    from verispec.data.decontaminate import FINGERPRINT, write_fingerprint
    from verispec.data.eval_prompts import default_eval_dir

    folder = Path(args.eval_dir) if args.eval_dir else default_eval_dir()
    if folder is None or not folder.is_dir():
        raise UserError("no eval prompts found: give --eval-dir (a folder of mt-bench.jsonl, gsm8k.jsonl, ...)")
    out = Path(args.out) if args.out else FINGERPRINT
    try:
        count = write_fingerprint(folder, out)
    except FileNotFoundError as e:
        raise UserError(f"--eval-dir {folder}: {e}") from None
    print(f"fingerprint: {count} eval 8-grams from {folder} -> {out}", file=sys.stderr)
    return 0
