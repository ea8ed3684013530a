"""verispec's own CPU kernels, compiled once per machine into the user cache.

`qlinear.cpp` holds weight-only linear kernels over GGUF's q4_1 / q8_0 blocks and bf16
rows, batch-invariant by construction and dispatched at run time to AVX-512, AVX2 or
scalar code (its head says how). It is built with torch's C++ extension builder the
first time it is needed (or by `scripts/setup`, which runs `python -m verispec.kernels`),
into `<cache>/kernels/<torch version>-<source hash>/`, and loaded from there afterwards.
A machine without a C++ compiler gets a clear message from `load()` and the engine keeps
to PyTorch's own kernels.

Checked by tests/test_qlinear.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import threading
from pathlib import Path

FORMATS = {"q4_1": 0, "q8_0": 1, "bf16": 2}
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}
BLOCK = 32
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
_SOURCE = Path(__file__).with_name("qlinear.cpp")
# -fopenmp: the kernels split their columns with at::parallel_for, which is inline in
# ATen's headers and runs serially unless the extension itself is compiled with OpenMP
# (it was, until stage 21 of docs/dspark-campaign.md: every kernel ran on one thread, and
# gemma3's decode step took 42.7 ms on 2 cores instead of 20.4). -lgomp resolves, at run
# time, to the libgomp.so.1 torch has already loaded (one OpenMP runtime, one thread pool:
# torch.set_num_threads governs both). A compiler without OpenMP gets the serial build;
# VERISPEC_SERIAL_KERNELS=1 asks for it (to measure what the threads buy).
_BASE_CFLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off")
BUILDS = {"openmp": (_BASE_CFLAGS + ("-fopenmp",), ("-lgomp",)), "serial": (_BASE_CFLAGS, ())}
FAILED = "build-failed.txt"  # in a build folder: that build failed where a later one worked
_lock = threading.Lock()
_module = None
_build: str | None = None  # which of BUILDS is loaded
_error: str | None = None


class KernelUnavailable(RuntimeError):
    """The extension could not be built or loaded on this machine."""


def build_id(build: str | None = None) -> str:
    """The source and the flags it is built with (the loaded build's, else the preferred
    one's): what a cached build, and a kernel plan measured on it
    (models/kernel_plan.py), are valid for."""
    cflags, ldflags = BUILDS[build or _build or "openmp"]
    return hashlib.sha256(_SOURCE.read_bytes() + " ".join(cflags + ldflags).encode()).hexdigest()[:12]


def _build_dir(build: str | None = None) -> Path:
    import torch

    from verispec.models.registry import cache_dir

    return cache_dir() / "kernels" / f"torch{torch.__version__.replace('+', '_')}-{build_id(build)}"


def threaded() -> bool:
    """Whether the loaded kernels split their work over torch's threads."""
    load()
    return _build == "openmp"


def load(verbose: bool = False):
    """The compiled extension (built on first use); KernelUnavailable if it cannot be."""
    global _module, _build, _error
    if _module is not None:
        return _module
    if _error is not None:
        raise KernelUnavailable(_error)
    with _lock:
        if _module is not None:
            return _module
        if os.environ.get("VERISPEC_NO_KERNELS") == "1":
            _error = "verispec's kernels are off (VERISPEC_NO_KERNELS=1)"
            raise KernelUnavailable(_error)
        failures = []  # "build: reason", in the order tried
        fresh = {}  # build folder -> reason, for builds that failed in this call
        builds = ["serial"] if os.environ.get("VERISPEC_SERIAL_KERNELS") == "1" else list(BUILDS)
        for build in builds:
            cflags, ldflags = BUILDS[build]
            folder = _build_dir(build)
            known = folder / FAILED
            if known.is_file():  # failed where a later build worked: not tried again at every start
                failures.append(f"{build}: {known.read_text().strip()} (remembered; delete {folder} to retry)")
                continue
            try:
                from torch.utils.cpp_extension import load as compile_and_load

                folder.mkdir(parents=True, exist_ok=True)
                _module = compile_and_load(name=f"verispec_qlinear_{build}", sources=[str(_SOURCE)],
                                           build_directory=str(folder), extra_cflags=list(cflags),
                                           extra_ldflags=list(ldflags), verbose=verbose)
                _build = build
                break
            except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: say which
                fresh[folder] = f"{type(e).__name__}: {str(e).strip()[:300]}"
                failures.append(f"{build}: {fresh[folder]}")
        if _module is None:  # nothing built: the toolchain may be what failed, so nothing is remembered
            _error = f"verispec's CPU kernels could not be built ({'; '.join(failures)})"
            raise KernelUnavailable(_error)
        for folder, reason in fresh.items():  # a later build worked, so these flags are what failed
            with contextlib.suppress(OSError):
                (folder / FAILED).write_text(reason + "\n")
        if failures:
            print(f"verispec: the kernels run on one thread (the OpenMP build failed: {failures[0]})", file=sys.stderr)
    return _module


def available() -> bool:
    try:
        load()
        return True
    except KernelUnavailable:
        return False


def isa() -> str:
    return ISA_NAMES[int(load().isa())]


def main() -> int:
    """`python -m verispec.kernels`: build (or find) the kernels and say which ISA they use."""
    try:
        load(verbose="-v" in sys.argv)
    except KernelUnavailable as e:
        print(f"kernels: {e}; verispec runs with PyTorch's kernels only", file=sys.stderr)
        return 1
    print(f"kernels: ok ({isa()}, {'threaded' if threaded() else 'one thread'}, in {_build_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
