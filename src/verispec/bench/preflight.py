"""Is this machine quiet enough to quote a benchmark from? Before the matrix runs: the
1-minute load average (against the core count) and any other process using more than 10%
of a core over a one-second look. A busy machine is warned about and stamped in the
results (`machine.busy`), because numbers from a dirty machine are not quotable.
"""

from __future__ import annotations

import os
import sys
import time

import psutil

BUSY_LOAD_PER_CORE = 0.5
BUSY_PROCESS_CPU = 10.0  # percent of one core


def other_busy_processes(seconds: float = 1.0) -> list[tuple[str, float]]:
    """(name and pid, % of a core) of processes outside this one's tree using the CPU."""
    mine = {os.getpid(), *(p.pid for p in psutil.Process().children(recursive=True))}
    procs = [p for p in psutil.process_iter(["name"]) if p.pid not in mine]
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(seconds)
    busy = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
        except psutil.Error:
            continue
        if pct > BUSY_PROCESS_CPU:
            busy.append((f"{p.info['name']} (pid {p.pid})", pct))
    return sorted(busy, key=lambda b: -b[1])


def preflight(threads: int, settle_s: float = 120.0) -> dict:
    """The machine's description and whether it is busy. With no other process on the CPU
    a high load average is the tail of work that just ended (it decays over a minute or
    two): wait up to `settle_s` for it to fall before judging."""
    import torch

    from verispec.models.kernel_plan import cpu_flags, cpu_name

    cores = os.cpu_count() or 1
    limit = BUSY_LOAD_PER_CORE * cores
    busy = other_busy_processes()
    deadline = time.monotonic() + settle_s
    if not busy and os.getloadavg()[0] > limit:
        print(f"preflight: load average {os.getloadavg()[0]:.2f} with nothing else running; waiting up to "
              f"{settle_s:.0f} s for it to settle", file=sys.stderr, flush=True)
        while os.getloadavg()[0] > limit and time.monotonic() < deadline and not busy:
            time.sleep(5)
            busy = other_busy_processes()
    load = os.getloadavg()[0]
    warnings = []
    if load > limit:
        warnings.append(f"load average {load:.2f} on {cores} cores")
    if busy:
        warnings.append("other processes on the CPU: " + ", ".join(f"{n} {pct:.0f}%" for n, pct in busy[:5]))
    return {"cpu": cpu_name(), "flags": cpu_flags(), "cores": cores, "threads": threads, "loadavg": load,
            "torch": torch.__version__, "busy": bool(warnings), "warnings": warnings}
