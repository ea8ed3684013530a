"""Which precision `dspark train` computes the drafter's forward in: measured per machine.

bf16 autocast (float32 master weights) halves a step where the CPU multiplies bf16 natively
(AVX512-BF16 or AMX: 1.8 s against 3.6 s for 16 sequences on the AVX-512 host the recipe was
written on), but where it does not, oneDNN emulates it: on an AVX2-only AMD EPYC a step of 16
sequences took 50 s under autocast against 2.4 s in float32. So `--precision auto` (the
default) times a forward + backward of a drafter-sized layer's MLP and of the draft head
(16,384 rows and its cross-entropy) both ways once per (CPU, flags, torch, threads), caches
the choice as JSON under `<cache>/profiles/`, and takes bf16 only when it measures at least
10% faster. The head is most of a real step, so a probe without it times the wrong work;
with it, an AVX-512 EPYC (BF16, no AMX) measured 297 ms under autocast against 477 ms in
float32 and trains in bf16 (a 6-step comparison of real steps there had looked the other
way: 4.6-8.4 s against 5.4-6.6 s, within its noise). A GPU trains under bf16 autocast.

Checked by tests/test_dspark_train.py (the choice is made once, cached under its key, and
`--precision` / `--fp32` force it).
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from verispec.models import profiles

PRECISIONS = ("auto", "bf16", "fp32")
ROWS, HIDDEN, FFN, VOCAB = 1024, 576, 1536, 16384  # anchor-block positions through a SmolLM2-sized layer and head


def profile_path(threads: int) -> Path:
    from verispec.models.kernel_plan import cpu_flags, cpu_name

    key = json.dumps({"what": "train-precision", "version": 2, "cpu": cpu_name(), "flags": cpu_flags(),
                      "torch": torch.__version__, "threads": threads}, sort_keys=True)
    return profiles.profile_path(f"train-precision-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")


def _time(autocast: bool, reps: int = 3) -> float:
    g = torch.Generator().manual_seed(0)
    w1 = torch.randn(FFN, HIDDEN, generator=g, requires_grad=True)
    w2 = torch.randn(HIDDEN, FFN, generator=g, requires_grad=True)
    head = (torch.randn(VOCAB, HIDDEN, generator=g) * HIDDEN ** -0.5).requires_grad_()
    x = torch.randn(ROWS, HIDDEN, generator=g)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=g)
    best = float("inf")
    for _ in range(reps + 1):  # the first is a warm-up
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, w1)), w2)
            logits = torch.nn.functional.linear(y, head)
        torch.nn.functional.cross_entropy(logits.float(), targets).backward()
        best = min(best, time.perf_counter() - start)
    return best


def measure() -> dict:
    fp32, bf16 = _time(False), _time(True)
    return {"fp32_ms": round(fp32 * 1e3, 2), "bf16_ms": round(bf16 * 1e3, 2),
            "choice": "bf16" if bf16 < 0.9 * fp32 else "fp32"}


def training_precision(requested: str, device: torch.device) -> tuple[str, str]:
    """(the precision, why) for `requested` in PRECISIONS on `device`."""
    if requested not in PRECISIONS:
        raise ValueError(f"precision {requested!r} is not one of {PRECISIONS}")
    if requested != "auto":
        return requested, "asked for"
    if device.type != "cpu":
        return "bf16", f"autocast on {device.type}"
    path = profile_path(torch.get_num_threads())
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        found = measure()
        profiles.save_profile(path, found)
    return found["choice"], f"measured here: a layer's MLP and the draft head, forward + backward, " \
                            f"{found['bf16_ms']} ms under bf16 autocast, {found['fp32_ms']} ms in float32"
