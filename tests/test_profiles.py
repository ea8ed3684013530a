"""Machine-wide profiles are written atomically: processes writing one profile at once never
leave a torn file, never replace each other's temp file, and leave no temp files behind.

Oracle: json.loads on every read while the writers run, and the final file equal to one writer's
whole record.
"""

import json
import subprocess
import sys

from verispec.models.profiles import profile_path, save_profile

WRITER = """
import sys
from pathlib import Path
from verispec.models.profiles import save_profile
me = int(sys.argv[2])
record = {"writer": me, "payload": [me] * 20000}  # big enough that a torn write would show
for _ in range(40):
    save_profile(Path(sys.argv[1]), record, indent=1)
"""


def test_profiles_live_under_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "cache"))
    assert profile_path("x.json") == (tmp_path / "cache" / "profiles" / "x.json").resolve()


def test_processes_writing_one_profile_at_once_never_leave_a_torn_file(tmp_path):
    path = tmp_path / "profiles" / "shared.json"
    save_profile(path, {"writer": -1, "payload": []})
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(i)]) for i in range(3)]
    reads = 0
    while any(w.poll() is None for w in writers):
        record = json.loads(path.read_text())  # raises on a half-written file
        assert record["payload"] == [record["writer"]] * len(record["payload"])
        reads += 1
    assert all(w.returncode == 0 for w in writers)
    final = json.loads(path.read_text())
    assert final["writer"] in (0, 1, 2) and final["payload"] == [final["writer"]] * 20000
    assert reads > 0
    assert sorted(p.name for p in path.parent.iterdir()) == ["shared.json"]  # no temp file left behind
