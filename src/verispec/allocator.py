"""Large tensors without page faults: the process's allocator tuned once (`keep_large_blocks`).

glibc serves an allocation above its mmap threshold (at most 32 MB by default on 64-bit) with
a fresh mmap and unmaps it on free, so every such tensor is faulted in 4 KiB page by page, and
zeroed by the kernel, each time it is allocated. At datagen's 64 rows, gemma3's logits alone
are 64 MB a step ([64, 262,144] float32) and the sampler's warped rows as much again;
`dspark features` allocates [T, 262,144] per sequence. Two settings, both needed:

- PyTorch's `THP_MEM_ALLOC_ENABLE=1`: tensors of 2 MB and more are aligned to 2 MB and
  advised as transparent huge pages, 512 times fewer faults. PyTorch reads it once, at its
  first allocation, so it is set only while torch is not yet imported.
- glibc's `mallopt`: the mmap threshold at 1 GiB and the trim threshold at 2 GiB, so a freed
  block stays in the heap and serves the next allocation. Alone it was erratic here (PyTorch
  allocates with 64-byte alignment, and a freed block was reused in 3 of 8 rounds).

Probe (throwaway, one thread, a 2-core AMD EPYC, campaign stage 31), a 64 MB tensor allocated
and filled, 8 rounds: default 55-72 ms and 16,385 faults each; huge pages alone 17-24 ms,
544 faults; mallopt alone 8.5-73 ms; both 10-16 ms, 0 faults after the second round.
tests/test_allocator.py counts the faults. What it costs: memory a process freed stays in its
heap for reuse, so its resident size stays near its peak.

Only for the CLI's commands (cli.main, before any model loads) and the benches that run them
in process; a library user's process is left alone. Without glibc (musl, macOS) mallopt is
skipped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
LARGE = 1 << 30  # allocations up to this size come from the heap
KEEP = (1 << 31) - 1  # the heap keeps up to this much free memory at its top

_state: dict | None = None


def keep_large_blocks() -> dict:
    """Tune this process as the module head says (once): {"huge_pages": PyTorch will advise
    them, "heap": glibc took the thresholds}."""
    global _state
    if _state is not None:
        return _state
    huge = "torch" not in sys.modules and os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1") == "1"
    _state = {"huge_pages": huge, "heap": _mallopt()}
    return _state


def _mallopt() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # some glibc versions refuse a threshold above their heap size limit: then keep the default
    return mallopt(M_MMAP_THRESHOLD, LARGE) == 1 and mallopt(M_TRIM_THRESHOLD, KEEP) == 1
