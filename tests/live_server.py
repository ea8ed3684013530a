"""A real `verispec serve` process on loopback, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(*args: str, timeout: float = 300.0, log: Path | None = None, env: dict | None = None):
    """Start `verispec serve ARGS` on a free port; yield its base URL (http://127.0.0.1:PORT)
    once /health answers; stop it afterwards. Its stderr goes to `log` (or is discarded)."""
    port = free_port()
    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(port), "--log-level", "warning", *args]
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                detail = Path(log).read_text()[-2000:] if log else "(no log)"
                raise RuntimeError(f"verispec serve exited with {proc.returncode}: {detail}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"verispec serve did not become healthy in {timeout:.0f} s")
            time.sleep(0.25)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        if log:
            out.close()
