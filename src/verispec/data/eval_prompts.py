"""DeepSpec's benchmark prompts (`../shared/eval-prompts`: mt-bench, gsm8k, humaneval,
mbpp; one `{"turns": [...]}` per line, `turns[0]` is the prompt). They are for measuring
only: `verispec dspark datagen` refuses them, and nothing trains on them.
"""

from __future__ import annotations

import json
from pathlib import Path

EVAL_SETS = ("mt-bench", "gsm8k", "humaneval", "mbpp")


def default_eval_dir() -> Path | None:
    """`shared/eval-prompts` in a folder above this checkout, if there is one."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent / "shared" / "eval-prompts"
        if candidate.is_dir():
            return candidate
    return None


def load_eval(folder: Path, name: str, count: int) -> list[str]:
    """The first `count` prompts (turns[0]) of one eval set."""
    path = Path(folder) / f"{name}.jsonl"
    if not path.is_file():
        from verispec.errors import UserError

        raise UserError(f"no eval dataset {path}")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
    return [r["turns"][0] for r in rows[:count]]
