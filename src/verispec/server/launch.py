"""Start an OpenAI-compatible server as a child process and wait until it answers.

Used by the live-server tests (tests/test_server.py) and the serving benchmark
(bench/serve_load.py), which also starts peers (llama.cpp, transformers) this way.
"""

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


def verispec_serve_command(port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "verispec.cli", "serve", "--port", str(port), "--log-level", "warning", *args]


@contextlib.contextmanager
def server_process(cmd: list[str], health_url: str, timeout: float = 300.0, log: Path | None = None,
                   env: dict | None = None):
    """Run `cmd`; yield the Popen once `health_url` answers 200; stop it afterwards. Its
    output goes to `log` (or is discarded); a failed start raises with the log's tail."""
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                detail = Path(log).read_text()[-2000:] if log else "(no log)"
                raise RuntimeError(f"{' '.join(cmd[:4])}... exited with {proc.returncode}: {detail}")
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{' '.join(cmd[:4])}... did not answer {health_url} in {timeout:.0f} s")
            time.sleep(0.25)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            out.close()


@contextlib.contextmanager
def live_server(*args: str, timeout: float = 300.0, log: Path | None = None, env: dict | None = None):
    """`verispec serve ARGS` on a free loopback port; yields its base URL."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with server_process(verispec_serve_command(port, *args), base + "/health", timeout, log, env):
        yield base
