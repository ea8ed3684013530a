"""Is this machine quiet enough to quote a benchmark from? Before the matrix runs: the
1-minute load average (against the core count) and any other process using more than 10%
of a core over a one-second look. A busy machine is warned about and stamped in the
results (`machine.busy`), because numbers from a dirty machine are not quotable.
"""

from __future__ import annotations

import os
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


def preflight(threads: int) -> dict:
    import torch

    from verispec.models.kernel_plan import cpu_flags, cpu_name

    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]
    warnings = []
    if load > BUSY_LOAD_PER_CORE * cores:
        warnings.append(f"load average {load:.2f} on {cores} cores")
    busy = other_busy_processes()
    if busy:
        warnings.append("other processes on the CPU: " + ", ".join(f"{n} {pct:.0f}%" for n, pct in busy[:5]))
    return {"cpu": cpu_name(), "flags": cpu_flags(), "cores": cores, "threads": threads, "loadavg": load,
            "torch": torch.__version__, "busy": bool(warnings), "warnings": warnings}
