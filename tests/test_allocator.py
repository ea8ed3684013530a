"""verispec.allocator: after `keep_large_blocks` (before torch loads), 64 MB tensors allocated
one after another are not faulted in page by page; by default every fresh one is.

Oracle: the kernel's count of minor page faults (getrusage) in a fresh interpreter per arm,
since the settings are per process and cannot be undone. No timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys
from verispec.allocator import keep_large_blocks
tuned = keep_large_blocks() if sys.argv[1] == "tuned" else {}
import torch
torch.empty(64 << 18).fill_(1.0)  # 64 MB, allocated, touched, freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    torch.empty(64 << 18).fill_(1.0)
print(json.dumps({"tuned": tuned, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def _faults(arm: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", PROBE, arm], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_large_tensors_are_reused_without_faulting_them_in_again():
    tuned, default = _faults("tuned"), _faults("default")
    if not any(tuned["tuned"].values()):
        pytest.skip(f"neither setting took here: {tuned['tuned']}")
    pages = 3 * (64 << 20) // 4096
    assert default["faults"] >= pages // 2, default  # the default faults each fresh tensor in
    assert tuned["faults"] < pages // 20, tuned  # the heap kept the memory

