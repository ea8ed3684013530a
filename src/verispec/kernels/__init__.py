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
_lock = threading.Lock()
_module = None
_error: str | None = None


class KernelUnavailable(RuntimeError):
    """The extension could not be built or loaded on this machine."""


def _build_dir() -> Path:
    import torch

    from verispec.models.registry import cache_dir

    digest = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:12]
    return cache_dir() / "kernels" / f"torch{torch.__version__.replace('+', '_')}-{digest}"


def load(verbose: bool = False):
    """The compiled extension (built on first use); KernelUnavailable if it cannot be."""
    global _module, _error
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
        try:
            from torch.utils.cpp_extension import load as build

            folder = _build_dir()
            folder.mkdir(parents=True, exist_ok=True)
            _module = build(name="verispec_qlinear", sources=[str(_SOURCE)], build_directory=str(folder),
                            extra_cflags=["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"], verbose=verbose)
        except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: say which
            _error = f"verispec's CPU kernels could not be built ({type(e).__name__}: {str(e).strip()[:300]})"
            raise KernelUnavailable(_error) from None
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
    print(f"kernels: ok ({isa()}, in {_build_dir()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
