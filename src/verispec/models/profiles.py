"""Machine-wide measurement caches: the kernel plan, step costs and training precision.

Each is a JSON file under the cache dir's `profiles/` folder, measured once per machine and
read by every later process. Processes can measure at once (the test suite's xdist workers, a
server beside a bench), so a write goes to a temp file named for the writing process and is
renamed into place: a reader sees the old file or a whole new one, never half of either, and
two writers never replace each other's temp file. Tested in tests/test_profiles.py (many
processes writing one profile at once; the file always parses and is one writer's whole record).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def profile_path(name: str) -> Path:
    """Where the profile called `name` lives (the cache dir is read on every call)."""
    from verispec.models.registry import cache_dir

    return cache_dir() / "profiles" / name


def save_profile(path: Path, record, indent: int | None = None) -> None:
    """Write `record` as JSON to `path` atomically (per-process temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(record, indent=indent, default=str))
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
