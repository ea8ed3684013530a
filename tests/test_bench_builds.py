"""bench/datagen_builds.py runs each build from the source git holds for it: checked against
`git show` (the oracle for what a revision's files are), and a name git does not know is refused."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("datagen_builds", ROOT / "bench" / "datagen_builds.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=True).stdout


def test_a_revision_runs_from_the_files_git_holds_for_it():
    bench = _bench()
    commit = bench.resolve("HEAD")
    assert commit == _git("rev-parse", "HEAD").decode().strip()
    src = bench.export(commit)
    assert src != ROOT / "src"
    for path in ("src/verispec/__init__.py", "src/verispec/engine/sampling.py", "src/verispec/kernels/qlinear.cpp"):
        assert (src.parent / path).read_bytes() == _git("show", f"{commit}:{path}")
    assert bench.export(".") == ROOT / "src"  # '.': this checkout as it stands


def test_a_name_git_does_not_know_is_refused():
    with pytest.raises(SystemExit, match="not a git revision"):
        _bench().resolve("no-such-revision-xyz")


def test_answers_are_read_as_datagen_writes_them(tmp_path):
    """Records as datagen writes them (json.dumps, ensure_ascii=False, one per "\\n"-ended line): an
    answer holding U+2028 stays one record, and a left-out record counts as no answer."""
    import json

    records = [{"id": "a", "answer": "one\u2028two", "answer_ids": [1, 2, 3]},
               {"id": "b", "left_out": "shares an 8-word run with an eval prompt"},
               {"id": "c", "answer": "three", "answer_ids": [4]}]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    assert _bench().answers(path) == {"a": [1, 2, 3], "c": [4]}
